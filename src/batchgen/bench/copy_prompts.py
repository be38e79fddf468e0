"""The copy workload's prompts (committed data): requests whose good answers copy much of the prompt.

Three kinds, as synthesis jobs ask them: fix one typo in a function and return the whole function;
return a JSON object with one field changed; implement a function whose signature and docstring are
given (answers restate them first). A small model does not always copy, which is part of the figure.
"""

from __future__ import annotations

_FUNCTIONS = [
    ('def moving_average(values, window):\n    """Mean of each run of `window` consecutive values."""\n'
     '    if window <= 0:\n        raise ValueError("window must be positive")\n    result = []\n'
     '    total = sum(values[:window])\n    result.append(total / window)\n'
     '    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n'
     '        result.append(totl / window)\n    return result\n'),
    ('def count_words(text):\n    """How often each lower-cased word occurs in `text`."""\n    counts = {}\n'
     '    for word in text.lower().split():\n        word = word.strip(".,;:!?")\n        if not word:\n'
     '            continue\n        counts[word] = counts.get(wrd, 0) + 1\n    return counts\n'),
    ('def merge_sorted(left, right):\n    """Merge two sorted lists into one sorted list."""\n    merged = []\n'
     '    i = j = 0\n    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n'
     '            merged.append(left[i])\n            i += 1\n        else:\n            merged.append(right[j])\n'
     '            j += 1\n    merged.extend(left[i:])\n    merged.extend(rigth[j:])\n    return merged\n'),
    ('def parse_config(lines):\n    """Read `key = value` lines into a dict, skipping comments and blanks."""\n'
     '    config = {}\n    for line in lines:\n        line = line.strip()\n'
     '        if not line or line.startswith("#"):\n            continue\n'
     '        key, _, value = line.partition("=")\n        config[key.strip()] = vlaue.strip()\n'
     '    return config\n'),
    ('def clamp(value, low, high):\n    """`value` limited to the range [low, high]."""\n    if low > high:\n'
     '        raise ValueError("low must not exceed high")\n    if value < low:\n        return low\n'
     '    if value > hihg:\n        return high\n    return value\n'),
    ('def flatten(nested):\n    """All items of a list of lists, in order, as one list."""\n    flat = []\n'
     '    for inner in nested:\n        for item in iner:\n            flat.append(item)\n    return flat\n'),
]

_JSON_EDITS = [
    ('{"id": 4182, "name": "Ada Lovelace", "email": "ada@example.com", "role": "analyst", '
     '"team": "research", "active": true, "languages": ["English", "French"], "manager_id": 17}',
     'role', '"lead analyst"'),
    ('{"order": "A-5521", "customer": "Grace Hopper", "items": [{"sku": "KB-01", "qty": 2}, '
     '{"sku": "MS-07", "qty": 1}], "status": "packed", "carrier": "DHL", "priority": false}',
     'status', '"shipped"'),
    ('{"city": "Lyon", "country": "France", "population": 522250, "area_km2": 47.87, '
     '"mayor": "Gregory Doucet", "founded": "43 BC", "twin_cities": ["Birmingham", "Milan"]}',
     'population', '522969'),
    ('{"title": "Quarterly report", "author": "Alan Turing", "pages": 42, "draft": true, '
     '"tags": ["finance", "q3", "internal"], "reviewers": ["Joan Clarke", "Max Newman"]}',
     'draft', 'false'),
    ('{"host": "db.internal", "port": 5432, "user": "reporting", "database": "sales", '
     '"ssl": true, "pool_size": 10, "timeout_s": 30, "replicas": ["db2.internal", "db3.internal"]}',
     'pool_size', '20'),
]

_SIGNATURES = [
    'def is_palindrome(text: str) -> bool:\n    """True when `text` reads the same forwards and backwards,\n'
    '    ignoring case, spaces and punctuation."""\n',
    'def chunk(items: list, size: int) -> list[list]:\n    """Split `items` into consecutive lists of `size`\n'
    '    items; the last one may be shorter."""\n',
    'def celsius_to_fahrenheit(celsius: float) -> float:\n    """The temperature `celsius` in degrees\n'
    '    Fahrenheit."""\n',
    'def unique_in_order(items: list) -> list:\n    """The items of `items` without repeats, in the order\n'
    '    of their first occurrence."""\n',
    'def word_lengths(sentence: str) -> dict[str, int]:\n    """Map each word of `sentence` to its number\n'
    '    of letters."""\n',
]


def copy_prompts() -> list[str]:
    """16 user messages, each answered well by copying most of it."""
    prompts = [f"Fix the one typo in this Python function and return the whole corrected function:\n\n{code}"
               for code in _FUNCTIONS]
    prompts += [f"Return this JSON object unchanged except that \"{field}\" becomes {value}. "
                f"Reply with the JSON only.\n\n{obj}" for obj, field, value in _JSON_EDITS]
    prompts += [f"Implement this Python function. Start your answer with its signature and docstring "
                f"exactly as given:\n\n{sig}" for sig in _SIGNATURES]
    return prompts

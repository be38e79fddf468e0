"""Text as lm-evaluation-harness compares it: its `regex` filter (answer extraction) and its
`exact_match` normalisers (HF evaluate's), plus the last number of a text for numeric answers."""

from __future__ import annotations

import math
import re
import string

from batchgen.metrics.spec import _Extracting, _Normalised

_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)
_NO_DIGITS = str.maketrans("", "", string.digits)
# A signed number with optional thousands separators and decimals: "1,234.5", "-3", ".5".
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?")


def extract_answer(text: str | None, spec: _Extracting) -> str:
    """lm-eval's RegexFilter on one response: re.findall, the match at group_select (a tuple of groups
    gives its first non-empty one), stripped; no match (or no text) gives the fallback."""
    if text is None:
        text = ""
    if spec.regex is None:
        return text
    matches = re.findall(spec.regex, text)
    if not matches:
        return spec.fallback
    try:
        match = matches[spec.group_select]
    except IndexError:
        return spec.fallback
    if isinstance(match, tuple):
        non_empty = [m for m in match if m]
        match = non_empty[0] if non_empty else spec.fallback
    return match.strip()


def normalise(text: str, spec: _Normalised) -> str:
    """HF evaluate's exact_match options in its order (lm-eval's exact_match), after an optional strip."""
    if spec.strip:
        text = text.strip()
    for pattern in spec.regexes_to_ignore:
        text = re.sub(pattern, "", text)
    if spec.ignore_case:
        text = text.lower()
    if spec.ignore_punctuation:
        text = text.translate(_NO_PUNCTUATION)
    if spec.ignore_numbers:
        text = text.translate(_NO_DIGITS)
    return text


def last_number(text: str | None) -> float | None:
    """The last number written in `text` ("$1,234.50" -> 1234.5); None when there is none."""
    if text is None:
        return None
    found = [m.group(0) for m in _NUMBER.finditer(text) if any(ch.isdigit() for ch in m.group(0))]
    if not found:
        return None
    value = float(found[-1].replace(",", ""))
    return value if math.isfinite(value) else None

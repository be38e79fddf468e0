"""Two texts side by side with their differences marked, word by word (difflib on word tokens)."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

_TOKEN_RE = re.compile(r"\s+|\w+|[^\w\s]")


@dataclass(frozen=True)
class Segment:
    text: str
    is_changed: bool


def _words(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def diff_texts(new: str, old: str) -> tuple[list[Segment], list[Segment]]:
    """Each text cut into runs of words, those the other text lacks marked as changed."""
    a, b = _words(new), _words(old)
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    new_segments: list[Segment] = []
    old_segments: list[Segment] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        changed = tag != "equal"
        if i2 > i1:
            new_segments.append(Segment("".join(a[i1:i2]), changed))
        if j2 > j1:
            old_segments.append(Segment("".join(b[j1:j2]), changed))
    return new_segments, old_segments

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
    return _joined(new_segments), _joined(old_segments)


def _joined(segments: list[Segment]) -> list[Segment]:
    """Neighbours of one kind merged; a run of spaces between two changes counts as changed, so a changed
    phrase reads as one mark rather than a mark per word."""
    for k in range(1, len(segments) - 1):
        if not segments[k].is_changed and not segments[k].text.strip() and "\n" not in segments[k].text \
                and segments[k - 1].is_changed and segments[k + 1].is_changed:
            segments[k] = Segment(segments[k].text, True)
    merged: list[Segment] = []
    for segment in segments:
        if merged and merged[-1].is_changed == segment.is_changed:
            merged[-1] = Segment(merged[-1].text + segment.text, segment.is_changed)
        else:
            merged.append(segment)
    return merged

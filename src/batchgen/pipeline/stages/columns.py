"""The columns a judge stage parses out of its JSON answers (filled in by the judge feature)."""

from __future__ import annotations


def judge_columns(stage: dict) -> list[str]:
    """The columns a stage mapping's JSON answer is parsed into (none yet)."""
    return []

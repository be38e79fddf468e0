"""The one error type that means "the job is wrong" (exit code 2), as opposed to a failure (exit code 1)."""

from __future__ import annotations


class JobError(Exception):
    """A bad job: invalid setting, missing column, unreadable input, missing model, refused output folder.

    Raised before any generation starts; the message names the key, file or column at fault.
    """

"""The grammar library (xgrammar), imported only when a constraint is first used.

A run without structured output never imports it, so it stays an optional extra:
`pip install 'batchgen[structured]'`.
"""

from __future__ import annotations

import importlib

LIBRARY = "xgrammar"
INSTALL_HINT = "pip install 'batchgen[structured]'"


class StructuredOutputUnavailable(ImportError):
    """The grammar library is not installed (or does not import)."""


def load_library():
    """The xgrammar module; StructuredOutputUnavailable naming the extra when it cannot be imported."""
    try:
        return importlib.import_module(LIBRARY)
    except ImportError as exc:
        raise StructuredOutputUnavailable(
            f"structured output (json / regex / choice / grammar constraints) needs the {LIBRARY} package, "
            f"which is not installed or does not import ({exc}): {INSTALL_HINT}") from exc

"""The grammar library (llguidance), imported only when a constraint is first used.

A run without structured output never imports it, so it stays an optional extra:
`pip install 'batchgen[structured]'`.
"""

from __future__ import annotations

import importlib

LIBRARY = "llguidance"
INSTALL_HINT = "pip install 'batchgen[structured]'"


class StructuredOutputUnavailable(ImportError):
    """The grammar library is not installed (or does not import)."""


def load_library():
    """The llguidance module (with its transformers tokenizer bridge, llguidance.hf, imported);
    StructuredOutputUnavailable naming the extra when it cannot be imported."""
    try:
        module = importlib.import_module(LIBRARY)
        importlib.import_module(f"{LIBRARY}.hf")
    except ImportError as exc:
        raise StructuredOutputUnavailable(
            f"structured output (json / regex / choice / grammar constraints) needs the {LIBRARY} package, "
            f"which is not installed or does not import ({exc}): {INSTALL_HINT}") from exc
    return module

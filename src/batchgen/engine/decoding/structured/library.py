"""The grammar library (llguidance), imported only when a constraint is first used.

A run without structured output never imports it, so it stays an optional extra:
`pip install 'batchgen[structured]'`.
"""

from __future__ import annotations

import importlib
import re

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


# A native panic's message is followed by a backtrace (frames, file paths of the build machine): cut there.
# Its parser errors may go on with a dump of the parser state (`<state>`): cut there too.
_BACKTRACE = re.compile(r"\s*(<backtrace>|<state>|stack backtrace:|note: run with `RUST_BACKTRACE).*", re.DOTALL)
MAX_MESSAGE_CHARS = 500


def library_message(text: str) -> str:
    """The library's error text on one line (its regex errors draw a caret under the spot), without the
    backtrace a native panic appends, at most MAX_MESSAGE_CHARS long (an error may quote the grammar)."""
    message = " ".join(_BACKTRACE.sub("", text).split())
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS - 3] + "..."

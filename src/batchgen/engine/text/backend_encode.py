"""Text -> token ids through a fast tokenizer's Rust backend, with the GIL released while it works.

`PreTrainedTokenizerFast.encode` calls the same backend (`encode_batch`), then turns its result into
Python lists (ids, attention mask) in Python loops that hold the GIL: about a second for a 9 MB
text, during which no other thread of the process runs. Reading `.ids` off the backend's encoding
gives the same ids without those loops, so a thread encoding a huge prompt leaves the server's
event loop and engine thread running.
"""

from __future__ import annotations


def backend_of(hf):
    """The Rust tokenizer behind `hf`, made to neither truncate nor pad (as `encode` without
    truncation asks it); None for a tokenizer without one (a slow, pure-Python tokenizer)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    return backend


def encode_ids(hf, backend, text: str, add_special_tokens: bool,
               split_special_tokens: bool | None = None) -> list[int]:
    """What `hf.encode(text, add_special_tokens=..., split_special_tokens=...)` returns (`backend`:
    backend_of(hf)). Not for two threads at once: it sets the backend's special-token mode."""
    if split_special_tokens is None:
        split_special_tokens = bool(getattr(hf, "split_special_tokens", False))
    if backend is None:
        return list(hf.encode(text, add_special_tokens=add_special_tokens,
                              split_special_tokens=split_special_tokens))
    if backend.encode_special_tokens != split_special_tokens:
        backend.encode_special_tokens = split_special_tokens
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

"""A request's body read up to the server's bound (--max-request-body-bytes): 413 past it, before the
rest is read."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from batchgen.openai.api_error import APIError

# The error for a body past the bound: (its length when declared, else None; the bound).
TooLarge = Callable[[int | None, int], APIError]


async def read_body(request: Request, max_bytes: int, too_large: TooLarge | None = None) -> bytes:
    """The request's body, or `too_large`'s error (default: 413) as soon as it is known to be longer
    than `max_bytes`: from its Content-Length before reading any of it, else (chunked) once the bytes
    read pass the bound."""
    too_large = too_large or body_too_large
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise too_large(int(declared), max_bytes)
    chunks, num_bytes = [], 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise too_large(None, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(num_bytes: int | None, max_bytes: int) -> APIError:
    """413 naming --max-request-body-bytes."""
    size = f"{num_bytes} bytes" if num_bytes is not None else "more"
    # The rest of the body is never read: the connection closes after the answer.
    return APIError(413, f"the request body is {size}, over this server's limit of {max_bytes} bytes "
                         "(--max-request-body-bytes)", "body", "request_too_large",
                    headers={"Connection": "close"})

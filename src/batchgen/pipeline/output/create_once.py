"""Create a small file only if nothing is there yet, whole or not at all: the race-free "first one wins".

Locally: the text goes to a hidden temp file, then `os.link` puts it at its name, which fails if the
name exists (atomic on POSIX, NFS included), so a reader never sees half a file and two writers never
both succeed. Object stores: a conditional put (S3 If-None-Match: *), through lease.py's stores.
"""

from __future__ import annotations

import os

from batchgen.pipeline.storage import Storage


def create_text_once(storage: Storage, name: str, text: str) -> bool:
    """Write `text` at `name` unless something is there already; True when this call created it."""
    final = storage.join(name)
    if not storage.is_local:
        from batchgen.pipeline.output.lease import conditional_store

        return conditional_store(storage.fs).create(final, text.encode()) is not None
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = storage.join(storage.temp_name(name))
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        return True
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

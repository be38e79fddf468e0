"""glibc malloc tuning: a freed large activation's pages are reused, not faulted in again."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from batchgen.engine.runner.cpu_allocator import keep_freed_memory


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_freed_64_mib_tensors_are_reused_instead_of_faulted_in_again():
    assert keep_freed_memory()  # CI runs on glibc Linux
    num_floats = 16 * 1024 * 1024  # 64 MiB = 16384 pages: above untuned glibc's mmap threshold (<= 32 MiB)
    for _ in range(2):  # the heap grows to hold one (and absorbs whatever earlier tests left)
        torch.ones(num_floats)
    before = _minor_faults()
    for _ in range(6):
        torch.ones(num_floats)  # allocated, touched, freed
    # Untuned, every repeat mmaps fresh memory and faults all 16384 pages in (98k faults); tuned,
    # the heap keeps the block and the repeats reuse it.
    assert _minor_faults() - before < 16384

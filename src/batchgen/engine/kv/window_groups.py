"""The KV pool of a model with sliding-window (local) and full-attention (global) layers: two block groups.

A local layer's query at position p reads keys at positions > p - W only, so its KV blocks wholly before
that are never read again. As vLLM's hybrid allocator does, the local layers get their own block group:
their caches are a separate, smaller pool, each sequence has a second block table for them (the same
logical indexing as its full table), and the blocks that fall out of every local layer's window are
freed as the sequence advances (kv_cache_manager.py). A sequence then holds at most W / block_size + 1
local blocks between steps, whatever its length; the global layers keep every block.

The budget that would hold `num_blocks` blocks of every layer is split between the groups: the local
pool gets what the running batch's windows can use (every sequence's window plus one step's chunk), the
global pool the rest, so a long-context job fits more tokens. The engine (its KV cache manager) and the
model runner (its caches) compute the same split from the same inputs (`windowed_kv_split`).

Used where the steps reach the caches through the block tables the runner packs per step: the C kernels
and Triton (tensor-parallel workers unpack the local sections after the model's; CUDA decode graphs keep
static buffers for them, decode_graphs.py). On SDPA (its staging rows keep a dense mirror per sequence)
the windows are masks over a full-length cache. Every rank splits its pool alike (same block counts).
"""

from __future__ import annotations

from dataclasses import dataclass

# Backends that read every layer's cache through the step's block tables, and nothing else.
WINDOWED_KV_BACKENDS = ("cpu", "triton")


@dataclass(frozen=True)
class WindowedKV:
    """How the KV pool is split between global and local layers."""

    local_layers: frozenset[int]  # layer indices with a sliding window (their caches: the local pool)
    window: int  # the widest local window, in tokens: blocks before it are freed
    num_blocks: int  # blocks of the global layers' pool (the full block tables index it)
    num_local_blocks: int  # blocks of the local layers' pool (the local block tables index it)


def window_start_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block a query at position `num_computed_tokens` (or later) reads in a layer with this
    window: the query sees positions > p - window, so positions before p - window + 1 are never read."""
    return max(0, num_computed_tokens - window + 1) // block_size


def max_local_blocks(window: int, block_size: int) -> int:
    """Local blocks a sequence holds between steps at most (a decode): ceil((W - 1) / bs) + 1 <= W / bs + 1."""
    return -(-(window - 1) // block_size) + 1


def window_group(windows: list[int | None], backend_name: str | None = None) -> tuple[frozenset[int], int] | None:
    """(the sliding-window layers, the widest window) when they get their own block group, else None: no
    windowed layer, no global layer (every layer's window is a mask then), or a backend outside
    WINDOWED_KV_BACKENDS (None: the default ones, cpu on the CPU and triton on CUDA)."""
    local = frozenset(i for i, w in enumerate(windows) if w is not None)
    if not local or len(local) == len(windows):
        return None
    if backend_name is not None and backend_name not in WINDOWED_KV_BACKENDS:
        return None
    return local, max(windows[i] for i in local)


def local_step_reserve_blocks(max_num_batched_tokens: int, block_size: int) -> int:
    """Local blocks the pool keeps beyond every sequence's window: one step's prefill chunks span up to
    max_num_batched_tokens positions whose blocks are freed only at the next step."""
    return -(-max_num_batched_tokens // block_size) + 1


def windowed_kv_split(windows: list[int | None], num_blocks: int, block_size: int, max_num_seqs: int,
                      max_num_batched_tokens: int, backend_name: str) -> WindowedKV | None:
    """The split of a pool of `num_blocks` full-model blocks, or None where the windows stay masks over a
    full-length cache (`window_group`).

    `windows`: each layer's sliding window (None: full attention). The local pool holds every running
    sequence's window plus one step's chunk, capped by `num_blocks`; the bytes it leaves go to the global
    pool: num_local_layers x (num_blocks - num_local_blocks) more blocks of num_global_layers layers.
    """
    group = window_group(windows, backend_name)
    if group is None:
        return None
    local, window = group
    num_global = len(windows) - len(local)
    wanted = max_num_seqs * max_local_blocks(window, block_size) + local_step_reserve_blocks(
        max_num_batched_tokens, block_size)
    num_local = min(wanted, num_blocks)
    num_global_blocks = num_blocks + (num_blocks - num_local) * len(local) // num_global
    return WindowedKV(local, window, num_global_blocks, num_local)


def model_windowed_kv(config, backend, num_layers: int, num_blocks: int) -> WindowedKV | None:
    """`windowed_kv_split` for a model's attention backend (its per-layer windows) under an EngineConfig:
    what the engine's KV cache manager and the model runner's caches both use."""
    return windowed_kv_split([backend.layer(i).sliding_window for i in range(num_layers)], num_blocks,
                             config.block_size, config.max_num_seqs, config.max_num_batched_tokens, backend.name)

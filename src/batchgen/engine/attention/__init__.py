"""Attention over the paged KV cache: one module per backend behind base.py's interface.

cpu.py: the C kernels, in place in the paged cache (CPU, float32). triton.py: the Triton kernels,
in place in the paged cache (CUDA). sdpa.py: torch's SDPA, the CPU's fallback for other dtypes
(decodes staged in dense rows, see decode_staging.py). kv_cache.py: the per-layer cache tensors
(model dtype or FP8 with per-layer scales). selector.py picks one backend when the model loads.
"""

from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder
from batchgen.engine.attention.kv_cache import LayerKVCache, allocate_kv_caches, copy_blocks
from batchgen.engine.attention.selector import ATTENTION_BACKENDS, select_attention_backend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "AttentionMetadataBuilder",
           "LayerKVCache", "allocate_kv_caches", "copy_blocks", "select_attention_backend"]

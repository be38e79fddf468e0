"""Attention over the paged KV cache: one module per backend behind base.py's interface.

cpu.py: the C kernels, in place in the paged cache (CPU, float32). sdpa.py: torch's SDPA for every
other device and dtype (decodes staged in dense rows, see decode_staging.py). selector.py picks
one when the model loads.
"""

from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder
from batchgen.engine.attention.selector import ATTENTION_BACKENDS, select_attention_backend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "AttentionMetadataBuilder",
           "select_attention_backend"]

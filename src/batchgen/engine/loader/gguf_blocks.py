"""`quantization: gguf`: a GGUF file's integer blocks kept as IntWeights instead of dequantized to float.

Blocks of 32 weights along each row (ggml's layout, one row = one output channel):
- Q8_0 (34 bytes): float16 d, 32 int8 q;               w = d * q         -> int8, symmetric, group 32
- Q4_0 (18 bytes): float16 d, 16 bytes of nibbles;     w = d * (q - 8)   -> int4, symmetric, group 32
- Q4_1 (20 bytes): float16 d, float16 m, 16 bytes;     w = d * q + m     -> int4, zero 0, minima m, group 32
In Q4_0 / Q4_1, byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
Every other type (Q4_K, Q5_K, Q6_K, ...) is dequantized to float as without `gguf`, with a logged note.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from batchgen.engine.parallel.shards import ShardFn, gguf_block_bytes
from batchgen.engine.quant.int_formats import IntWeight
from batchgen.engine.quant.int_formats.int_weight import select_rows

log = logging.getLogger("batchgen.engine")

BLOCK = 32
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# GGUF base names of the decoder's linear layers (the loader maps them to HF names).
LINEAR_BASES = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Tensors the model fuses into one layer (qkv_proj, gate_up_proj): kept only when every part is.
FUSED_BASES = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def decode_blocks(raw: np.ndarray, type_name: str, out_features: int, in_features: int) -> IntWeight:
    """One tensor's raw bytes (N, bytes per row) uint8 -> IntWeight with groups of 32."""
    if in_features % BLOCK:
        raise ValueError(f"a {type_name} row of {in_features} weights is not whole blocks of {BLOCK}")
    num_groups = in_features // BLOCK
    blocks = np.ascontiguousarray(raw).reshape(out_features, num_groups, -1)  # (N, G, block bytes)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]  # (N, G)
    if type_name == "Q8_0":
        q = blocks[:, :, 2:34].copy().view(np.int8).astype(np.int16) + 128  # (N, G, 32) codes q + 128
        return IntWeight(qweight=torch.from_numpy(q.reshape(out_features, -1).astype(np.uint8)),
                         scales=torch.from_numpy(d), zeros=None, group_size=BLOCK, bits=8)
    nibbles = blocks[:, :, 2:18] if type_name == "Q4_0" else blocks[:, :, 4:20]  # (N, G, 16)
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=2)  # (N, G, 32): weights 0..15, then 16..31
    codes = torch.from_numpy(q.reshape(out_features, -1).astype(np.uint8))
    if type_name == "Q4_0":
        return IntWeight(qweight=codes, scales=torch.from_numpy(d), zeros=None, group_size=BLOCK, bits=4)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]  # (N, G)
    return IntWeight(qweight=codes, scales=torch.from_numpy(d), zeros=torch.zeros(d.shape, dtype=torch.int16),
                     group_size=BLOCK, bits=4, offsets=torch.from_numpy(m))


def read_gguf_int_weights(path: Path, hf_name, row_permutation, shard: ShardFn | None = None) -> dict[str, IntWeight]:
    """{HF layer name (no ".weight"): IntWeight} for the decoder linear layers stored in KEPT_TYPES.

    hf_name(tensor name) -> HF name; row_permutation(base, num_rows) -> index array or None (llama.cpp's
    q/k row order, undone as for float weights). Other types are left for the float path, noted once,
    and so are the kept-type parts of a fused layer whose other parts are not kept (llama.cpp mixes
    types within a layer, e.g. a K-quant attn_k beside a Q4_0 attn_q). `shard` (tensor parallelism):
    only this rank's rows, or its whole blocks of columns, are decoded (row_permutation then counts
    the rank's heads).
    """
    from batchgen.engine.loader.gguf_loader import _reader

    reader = _reader(path)
    kept: dict[str, IntWeight] = {}
    dequantized: dict[str, int] = {}
    linear = [t for t in reader.tensors if _is_linear(t.name)]
    names = {t.name for t in linear}
    kept_names = {t.name for t in linear if t.tensor_type.name in KEPT_TYPES}
    for tensor in linear:
        parts = tensor.name.split(".")
        type_name = tensor.tensor_type.name
        siblings = next((group for group in FUSED_BASES if parts[2] in group), (parts[2],))
        sibling_names = [f"blk.{parts[1]}.{b}.weight" for b in siblings]
        if type_name not in KEPT_TYPES or any(n in names and n not in kept_names for n in sibling_names):
            dequantized[type_name] = dequantized.get(type_name, 0) + 1
            continue
        in_features, out_features = (int(d) for d in tensor.shape)
        raw = tensor.data  # (out_features, bytes per row)
        if shard is not None:
            spec = shard(hf_name(tensor.name), (out_features, in_features))
            raw = gguf_block_bytes(raw, spec, BLOCK, raw.shape[1] // (in_features // BLOCK), in_features,
                                   f"{path}: {tensor.name}")
            if spec is not None:
                out_features, in_features = (spec.end - spec.start, in_features) if spec.dim == 0 else \
                    (out_features, spec.end - spec.start)
        w = decode_blocks(raw, type_name, out_features, in_features)
        perm = row_permutation(parts[2], out_features)
        if perm is not None:
            w = select_rows(w, torch.from_numpy(perm))
        kept[hf_name(tensor.name).removesuffix(".weight")] = w
    if dequantized:
        log.info("gguf: %s linear tensors have no kept-block form here (or share a fused layer with one that "
                 "has none) and are dequantized to float",
                 ", ".join(f"{n} {t}" for t, n in sorted(dequantized.items())))
    log.info("gguf: %d linear tensors kept as their %s blocks", len(kept), "/".join(KEPT_TYPES))
    return kept


def _is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEAR_BASES and parts[3] == "weight"

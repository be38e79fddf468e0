"""How one model is split over tensor-parallel ranks: which heads, MLP channels and vocabulary rows a rank holds.

Megatron-style, as vLLM, SGLang and nano-vllm split a Llama block:
- column-parallel (each rank a slice of the output rows): the fused q/k/v projection (its query heads
  and the KV heads they read) and the fused gate/up projection (a slice of the MLP's channels);
- row-parallel (each rank the matching slice of the input columns, its partial product summed by
  one all-reduce): o_proj and down_proj;
- vocabulary-parallel: the embedding and lm_head, a slice of the vocabulary rows each. A token's
  embedding is one rank's row (the others add zeros: the all-reduce is exact), and rank 0 gathers
  the logits' column slices. `is_vocab_parallel=False` keeps both whole on every rank instead
  (bench/tensor_parallel.py measures the two).

Heads go in whole KV groups (a KV head with the query heads that read it), as evenly as they split:
a model whose head counts do not divide by the rank count (the bundled SmolLM2: 9 query heads over
3 KV heads) still splits, one rank holding a group more. With more ranks than KV heads each rank
holds one KV head (replicated on the ranks that share it, as vLLM does) and a share of its query
heads. MLP channels and vocabulary rows split in contiguous, near-equal slices; every rank holds
ceil(V / N) vocabulary rows, the last rank's tail zero rows (dropped from the gathered logits), so
the logits gather takes equal shapes.

A rank's model is the full model's ModelConfig with its own head, channel and vocabulary counts
(`rank_config`): the modules, the KV pool and the capacity arithmetic (weight_bytes,
kv_bytes_per_token) then follow from it unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from batchgen.engine.models.config import ModelConfig

# HF module names by how they split (the model fuses q/k/v and gate/up; checkpoints keep them apart).
_COLUMN_PARALLEL = {"q_proj": "query", "k_proj": "kv", "v_proj": "kv", "gate_proj": "intermediate",
                    "up_proj": "intermediate"}
_ROW_PARALLEL = {"o_proj": "query", "down_proj": "intermediate"}
# Column-parallel layers some checkpoints store fused (GLM-4's gate_up_proj): a rank's rows of them are
# two or three ranges, which one Shard does not describe; refused by name.
_FUSED_IN_CHECKPOINT = ("qkv_proj", "gate_up_proj")
_VOCABULARY = ("embed_tokens", "lm_head")
# Norms whose weight spans a whole projection when a family norms over all heads (OLMo 2).
_WHOLE_PROJECTION_NORMS = {"q_norm": "query", "k_norm": "kv"}
# A routed expert's projections (layers/moe.py; Mixtral's w1/w3/w2 and the Qwen names): every rank holds every
# expert's slice of the expert channels, gate/up rows and down columns (vLLM's tensor parallelism for MoE).
_EXPERT_COLUMN_PARALLEL = ("w1", "w3", "gate_proj", "up_proj")
_EXPERT_ROW_PARALLEL = ("w2", "down_proj")


def even_split(num_items: int, num_parts: int, part: int) -> tuple[int, int]:
    """[start, end) of part `part` when num_items split into num_parts contiguous, near-equal parts."""
    return num_items * part // num_parts, num_items * (part + 1) // num_parts


class Shard(NamedTuple):
    """This rank's slice of a checkpoint tensor: rows or columns [start, end) along `dim`; `size`:
    the slice's length on the rank (larger than end - start only for the last vocabulary slice,
    padded with zero rows)."""

    dim: int
    start: int
    end: int
    size: int


def pad_rows(part: torch.Tensor, size: int) -> torch.Tensor:
    """`part` with zero rows appended up to `size` rows (the vocabulary's tail on the last rank)."""
    if part.shape[0] == size:
        return part.contiguous()
    padded = part.new_zeros((size, *part.shape[1:]))
    padded[:part.shape[0]] = part
    return padded


@dataclass(frozen=True)
class TensorParallelLayout:
    """Rank `rank` of `world_size`: the [start, end) ranges of the model's whole dimensions it holds."""

    rank: int
    world_size: int
    head_dim: int
    query_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # rows held: [start, start + vocab_rows); past vocab_size they are zeros
    vocab_size: int  # the model's whole vocabulary (the logits' width)
    is_vocab_parallel: bool = True
    # The whole model's counts, which cut a checkpoint tensor stored already fused (see fused_rows).
    total_query_heads: int = 0
    total_kv_heads: int = 0
    total_intermediate: int = 0
    # MoE: the rank's slice of every routed expert's channels (moe_intermediate_size); (0, 0) in a dense model.
    moe_intermediate: tuple[int, int] = (0, 0)
    # ... and of the shared expert's (shared_expert_intermediate_size; Qwen2-MoE), split as a dense MLP is;
    # its 1 x H sigmoid gate is held whole (every rank scales its partial sums by the same factor).
    shared_intermediate: tuple[int, int] = (0, 0)

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int, world_size: int, is_vocab_parallel: bool = True) -> TensorParallelLayout:
        """The layout of `rank`; ValueError when the model cannot be split over world_size ranks."""
        check_can_split(cfg, world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        if world_size <= cfg.num_kv_heads:
            kv = even_split(cfg.num_kv_heads, world_size, rank)
            query = (kv[0] * group, kv[1] * group)
        else:  # more ranks than KV heads: each holds one, shared by the ranks next to it
            head = rank * cfg.num_kv_heads // world_size
            sharing = [r for r in range(world_size) if r * cfg.num_kv_heads // world_size == head]
            start, end = even_split(group, len(sharing), sharing.index(rank))
            kv, query = (head, head + 1), (head * group + start, head * group + end)
        if is_vocab_parallel:
            rows = -(-cfg.vocab_size // world_size)
            vocab = (rank * rows, rank * rows + rows)
        else:
            vocab = (0, cfg.vocab_size)
        return cls(rank, world_size, cfg.head_dim, query, kv, even_split(cfg.intermediate_size, world_size, rank),
                   vocab, cfg.vocab_size, is_vocab_parallel, total_query_heads=cfg.num_heads,
                   total_kv_heads=cfg.num_kv_heads, total_intermediate=cfg.intermediate_size,
                   moe_intermediate=even_split(cfg.moe_intermediate_size, world_size, rank),
                   shared_intermediate=even_split(cfg.shared_expert_intermediate_size, world_size, rank))

    @property
    def num_query_heads(self) -> int:
        return self.query_heads[1] - self.query_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_intermediate(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's modules have: its heads, MLP channels and vocabulary rows."""
        return dataclasses.replace(cfg, num_heads=self.num_query_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.num_intermediate, vocab_size=self.vocab_rows,
                                   moe_intermediate_size=self.moe_intermediate[1] - self.moe_intermediate[0],
                                   shared_expert_intermediate_size=self.shared_intermediate[1] - self.shared_intermediate[0])

    def fused_rows(self, module: str) -> list[tuple[int, int]] | None:
        """The [start, end) rows this rank holds of a checkpoint tensor stored already fused (Phi-3),
        in order: its query, key and value rows of `qkv_proj`, its gate and up rows of `gate_up_proj`;
        None for other modules. The model cuts them from the whole tensor (`shard` leaves it whole)."""
        dim = self.head_dim
        if module == "qkv_proj":
            q_rows, kv_rows = self.total_query_heads * dim, self.total_kv_heads * dim
            (q_start, q_end), (kv_start, kv_end) = self.query_heads, self.kv_heads
            return [(q_start * dim, q_end * dim), (q_rows + kv_start * dim, q_rows + kv_end * dim),
                    (q_rows + kv_rows + kv_start * dim, q_rows + kv_rows + kv_end * dim)]
        if module == "gate_up_proj":
            (start, end), channels = self.intermediate, self.total_intermediate
            return [(start, end), (channels + start, channels + end)]
        return None

    def shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """This rank's slice of the checkpoint tensor `name` (an HF name) of `shape`; None: held whole.

        Column-parallel layers slice every tensor with one entry per output row (weight, bias,
        per-channel scales); row-parallel layers slice their weight's columns and keep per-output
        scales whole; a per-tensor scale is held whole everywhere.
        """
        parts = name.removeprefix("model.").split(".")
        if len(parts) < 2:
            return None
        module, kind = parts[-2], parts[-1]
        head_dim = self.head_dim
        if "experts" in parts:
            return self._expert_shard(name, parts, shape)
        if len(parts) >= 3 and parts[-3] == "shared_expert":  # gate/up rows, down columns of its channels
            start, end = self.shared_intermediate
            if module in ("gate_proj", "up_proj"):
                return Shard(0, start, end, end - start) if _is_per_row(shape, kind) else None
            if module == "down_proj" and kind == "weight" and len(shape) == 2:
                return Shard(1, start, end, end - start)
            raise ValueError(f"checkpoint tensor {name!r}: a shared expert's {kind} does not split with "
                             "tensor_parallel_size > 1")
        if self.fused_rows(module) is not None:  # stored fused: its rows are no one range
            if kind != "weight" and _is_per_row(shape, kind):
                raise ValueError(f"checkpoint tensor {name!r}: an already-fused layer's {kind} does not split "
                                 f"with tensor_parallel_size > 1 (its float weight does)")
            return None  # held whole; the model cuts its rows (fused_rows)
        if module in _WHOLE_PROJECTION_NORMS and kind == "weight" and len(shape) == 1:
            # OLMo 2's q/k norms over the whole projection split with its rows; per-head ones (head_dim
            # wide: Qwen3, Gemma 3) are held whole.
            start, end = self._range(_WHOLE_PROJECTION_NORMS[module])
            total = self.total_query_heads if module == "q_norm" else self.total_kv_heads
            if shape[0] == total * head_dim and total > 1:
                return Shard(0, start * head_dim, end * head_dim, (end - start) * head_dim)
            return None
        if module in _COLUMN_PARALLEL:
            start, end = self._range(_COLUMN_PARALLEL[module])
            if module in ("q_proj", "k_proj", "v_proj"):
                start, end = start * head_dim, end * head_dim
            return Shard(0, start, end, end - start) if _is_per_row(shape, kind) else None
        if module in _ROW_PARALLEL:
            if kind == "bias":
                raise ValueError(f"checkpoint tensor {name!r}: a bias on the row-parallel {module} is not "
                                 f"supported with tensor_parallel_size > 1")
            if kind != "weight" or len(shape) != 2:
                return None
            start, end = self._range(_ROW_PARALLEL[module])
            if module == "o_proj":
                start, end = start * head_dim, end * head_dim
            return Shard(1, start, end, end - start)
        if module in _VOCABULARY and self.is_vocab_parallel and _is_per_row(shape, kind):
            start = min(self.vocab[0], self.vocab_size)
            return Shard(0, start, min(self.vocab[1], self.vocab_size), self.vocab_rows)
        return None

    def _expert_shard(self, name: str, parts: list[str], shape: tuple[int, ...]) -> Shard | None:
        """A routed expert's tensor (`...experts.N.<projection>.weight`): its rows (gate, up) or columns (down)
        of this rank's expert channels."""
        module, kind = parts[-2], parts[-1]
        start, end = self.moe_intermediate
        if parts[-2] == "experts" and kind in ("gate_up_proj", "down_proj"):  # stored fused (E, 2I, H) / (E, H, I):
            return None  # read whole; layers/moe.py's ExpertCheckpoint cuts the rank's gate, up and down ranges
        if kind != "weight" or module not in _EXPERT_COLUMN_PARALLEL + _EXPERT_ROW_PARALLEL:
            raise ValueError(f"checkpoint tensor {name!r}: only expert weights (experts.N.<gate_proj|up_proj|"
                             f"down_proj|w1|w2|w3>.weight, or experts.<gate_up_proj|down_proj> stored fused) split "
                             f"with tensor_parallel_size > 1; expert biases and scales do not yet")
        return Shard(0 if module in _EXPERT_COLUMN_PARALLEL else 1, start, end, end - start)

    def _range(self, what: str) -> tuple[int, int]:
        return {"query": self.query_heads, "kv": self.kv_heads, "intermediate": self.intermediate}[what]


def _is_per_row(shape: tuple[int, ...], kind: str) -> bool:
    """A tensor with one entry (or row) per output row: weights, biases and per-channel scales (a
    per-tensor scale has one value)."""
    return bool(shape) and kind in ("weight", "bias", "weight_scale") and (kind != "weight_scale" or shape[0] > 1)


def check_can_split(cfg: ModelConfig, world_size: int) -> None:
    """ValueError, naming the counts, when a rank would get no query head or no MLP channel."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if world_size > cfg.num_kv_heads and cfg.qk_norm_over_heads:
        # The ranks sum their slices' squares (layers/attention.py): a KV head replicated on several
        # ranks would be counted once per rank.
        raise ValueError(f"tensor_parallel_size {world_size}: {cfg.architecture or cfg.model_type} norms k "
                         f"over all its {cfg.num_kv_heads} KV heads at once, which splits over at most "
                         f"{cfg.num_kv_heads} ranks (more would replicate a KV head); use tensor_parallel_size "
                         f"<= {cfg.num_kv_heads}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"{cfg.num_heads} query heads do not group evenly over {cfg.num_kv_heads} KV heads")
    # Ranks sharing one KV head split its query heads: each needs one.
    if -(-world_size // cfg.num_kv_heads) > cfg.num_heads // cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} leaves a rank without a query head: the model has "
                         f"{cfg.num_heads} query heads over {cfg.num_kv_heads} KV heads")
    if cfg.shared_expert_intermediate_size and world_size > cfg.shared_expert_intermediate_size:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the shared expert's "
                         f"{cfg.shared_expert_intermediate_size} channels")
    if cfg.is_moe and world_size > cfg.moe_intermediate_size:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the experts' {cfg.moe_intermediate_size} channels")
    if world_size > cfg.intermediate_size:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the MLP's {cfg.intermediate_size} channels")


def all_layouts(cfg: ModelConfig, world_size: int, is_vocab_parallel: bool = True) -> list[TensorParallelLayout]:
    """Every rank's layout, rank order."""
    return [TensorParallelLayout.plan(cfg, rank, world_size, is_vocab_parallel) for rank in range(world_size)]

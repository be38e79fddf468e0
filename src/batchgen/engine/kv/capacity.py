"""KV-cache capacity arithmetic: one function for bytes per token, used by the pool and `batchgen plan`.

A model whose sliding-window layers get their own block group (kv/window_groups.py) is priced per layer
type: the global layers at the full context, the local ones over their window, plus one step's chunk."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from batchgen.engine.config import EngineConfig, parse_memory_size
from batchgen.engine.kv.expert_bytes import (
    expert_block_bytes,
    expert_bytes,
    expert_parameters,
    num_moe_layers,
)
from batchgen.engine.kv.window_groups import local_step_reserve_blocks, max_local_blocks, window_group
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.quant.int_formats.rtn import INT4_GROUP_SIZE

# kv_cache_memory "auto" on the CPU: what the engine can use (max_num_seqs sequences of max_model_len
# tokens; a job gives a tighter bound, pipeline/kv_budget.py), at most 20% of RAM and 4 GiB (the
# weights, activations and the rest of the machine keep the remainder). Every byte of the pool is
# resident from the start (it is zeroed), so it is the engine's largest share of RSS on the CPU. On CUDA
# the pool is sized by engine/kv/gpu_memory.py.
CPU_KV_CAP_BYTES = 4 * 2**30
CPU_KV_RAM_FRACTION = 0.20


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(kv_dtype)


def _total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # no sysconf figure on this platform: assume a 16 GiB machine
        return 16 * 2**30


def cpu_kv_cap_bytes(ram: int | None = None) -> int:
    """The most kv_cache_memory auto gives off CUDA: the smaller of 4 GiB and 20% of RAM."""
    return int(min(CPU_KV_CAP_BYTES, CPU_KV_RAM_FRACTION * (_total_ram_bytes() if ram is None else ram)))


def auto_kv_bytes(num_seqs: int, tokens_per_seq: int, bytes_per_token: int, block_size: int, max_model_len: int,
                  cap_bytes: int) -> int:
    """kv_cache_memory auto off CUDA: `num_seqs` sequences of `tokens_per_seq` tokens each in whole blocks
    (what can run at once), never less than one sequence of max_model_len (the engine's minimum), at most
    `cap_bytes` (cpu_kv_cap_bytes; below the minimum the engine refuses to start, naming both)."""
    per_seq = -(-min(tokens_per_seq, max_model_len) // block_size) * block_size
    minimum = -(-max_model_len // block_size) * block_size
    return min(max(num_seqs * per_seq, minimum) * bytes_per_token, cap_bytes)


def kv_cache_budget_bytes(config: EngineConfig, device: torch.device, bytes_per_token: int,
                          max_model_len: int) -> int:
    """Bytes for the KV pool off CUDA: an explicit size, a fraction of RAM, or "auto" (max_num_seqs
    sequences of max_model_len, capped: auto_kv_bytes). CUDA: engine/kv/gpu_memory.py plan_gpu_kv_cache
    (a profiling step)."""
    if device.type == "cuda":
        raise ValueError("on CUDA the KV pool is sized by engine/kv/gpu_memory.py (a profiling step)")
    setting = config.kv_cache_memory
    if setting == "auto":
        return auto_kv_bytes(config.max_num_seqs, max_model_len, bytes_per_token, config.block_size, max_model_len,
                             cpu_kv_cap_bytes())
    value = parse_memory_size(setting)
    return int(_total_ram_bytes() * value) if isinstance(value, float) else value


def num_kv_blocks(budget_bytes: int, cfg: ModelConfig, kv_dtype: torch.dtype, block_size: int) -> int:
    return budget_bytes // (kv_bytes_per_token(cfg, kv_dtype) * block_size)


# ---- planning (`batchgen plan`): the same arithmetic, from a ModelConfig alone ---------------------

FP8_SCALE_BYTES = 4  # float32, one per output channel

# Margin on top of weights + KV, shown separately by the planner:
# - fragmentation: 10% of the KV bytes. A paged pool wastes under one block per sequence, but the
#   allocator, the CUDA context and uneven request lengths take their share too.
# - activations: the transient tensors of one step (see activation_workspace_bytes).
KV_FRAGMENTATION_FRACTION = 0.10


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str = "none",
                 quantize_lm_head: bool = False, declared=None,
                 int_calibration: str = EngineConfig.int_calibration) -> int:
    """Bytes of the model's weights as the engine holds them (rotary tables excluded), from the
    config's shapes alone (no weights read); equals the engine's measurement from tensor storage.

    Linear layers per `quantization` (int_linear_bytes for the integer formats); embeddings, norms,
    biases and (unless quantize_lm_head) lm_head stay in `dtype`; a tied lm_head shares the
    embedding's storage, but a quantized lm_head is a copy of its own. `declared`: the checkpoint's
    DeclaredQuantization for gptq / awq / compressed-tensors (bits, group size, zeros, act-order).
    int_calibration: the engine setting; int8 / int4 at load with activation_aware hold one
    pre-quant scale per input column of each decoder linear layer (not lm_head) in `dtype`.
    """
    elem = dtype_bytes(dtype)

    def linear_bytes(out_features: int, in_features: int, quantized: bool) -> int:
        if not quantized or quantization in ("none", "auto", "gguf"):
            return out_features * in_features * elem
        if quantization == "fp8":
            return out_features * in_features + out_features * FP8_SCALE_BYTES
        return int_linear_bytes(out_features, in_features, dtype, quantization, declared)

    # Activation-aware int8 / int4 at load: a pre-quant scale per input column of each decoder layer.
    has_pre_quant = quantization in ("int8", "int4") and int_calibration == "activation_aware"
    per_layer = sum(linear_bytes(n, k, True) + (k * elem if has_pre_quant else 0)
                    for n, k in cfg.linear_shapes().values())
    per_layer += 2 * cfg.hidden_size * elem  # two norms a block: before attention and MLP (OLMo 2: after)
    if cfg.sandwich_norms:
        per_layer += 2 * cfg.hidden_size * elem  # GLM-4's norms on the attention and MLP outputs
    if cfg.attention_bias:
        per_layer += (cfg.q_size + 2 * cfg.kv_size) * elem
    if cfg.o_proj_bias:
        per_layer += cfg.hidden_size * elem
    if cfg.attention_sinks:  # gpt-oss: a sink logit per query head
        per_layer += cfg.num_heads * elem
    if cfg.qk_norm:  # per head (head_dim wide each) or over all heads (q_size and kv_size wide)
        per_layer += (cfg.q_size + cfg.kv_size if cfg.qk_norm_over_heads else 2 * cfg.head_dim) * elem
    total = cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size * elem + cfg.hidden_size * elem
    if cfg.is_moe:  # the MoE layers hold a router and the experts (kv/expert_bytes.py) instead of the dense MLP
        shapes = cfg.linear_shapes()
        dense_mlp = sum(linear_bytes(*shapes[name], True) + (shapes[name][1] * elem if has_pre_quant else 0)
                        for name in ("gate_up_proj", "down_proj"))
        moe_block = expert_block_bytes(cfg, elem, is_fp8_experts(cfg, quantization))
        if cfg.shared_expert_intermediate_size:  # a gated MLP (plain linear layers) and its 1 x H gate
            shared, hidden = cfg.shared_expert_intermediate_size, cfg.hidden_size
            moe_block += sum(linear_bytes(n, k, True) + (k * elem if has_pre_quant else 0)
                             for n, k in ((2 * shared, hidden), (hidden, shared), (1, hidden)))
        total += num_moe_layers(cfg) * (moe_block - dense_mlp)
    is_lm_head_quantized = quantize_lm_head and quantization in ("fp8", "int8", "int4")
    if is_lm_head_quantized or not cfg.tie_word_embeddings:
        total += linear_bytes(*cfg.lm_head_shape, is_lm_head_quantized)
    return total


def int_linear_bytes(out_features: int, in_features: int, dtype: torch.dtype, quantization: str,
                     declared=None) -> int:
    """One integer linear layer as IntLinear holds it: bits / 8 per code plus the side tables.

    int8 / int4 at load: symmetric per channel / asymmetric groups of 128. Side tables: for a float32
    model (the CPU kernels) the scale and -zero * scale per group in float32 (a symmetric int8 weight:
    the scale only); for 16-bit models (the GPU kernel) the scale and, when asymmetric, the zero in
    16 bits. Act-order checkpoints add one group index per input column (int64 on the CPU, int32 on GPU).
    """
    if quantization == "int8":
        bits, group_size, symmetric, act_order = 8, -1, True, False
    elif quantization == "int4":
        bits, group_size, symmetric, act_order = 4, INT4_GROUP_SIZE, False, False
    elif declared is not None:
        bits, group_size = declared.bits, declared.group_size
        symmetric, act_order = declared.is_symmetric, declared.has_act_order
    else:
        raise ValueError(f"quantization {quantization} needs the checkpoint's declared quantization_config")
    n, k = out_features, in_features
    num_groups = 1 if group_size <= 0 else -(-k // group_size)
    codes = n * k if bits == 8 else n * -(-k // 2)
    is_float32 = dtype == torch.float32
    side_elem = 4 if is_float32 else 2
    num_tables = 1 + (not symmetric or (is_float32 and bits == 4))
    g_idx = k * (8 if is_float32 else 4) if act_order else 0
    return codes + n * num_groups * side_elem * num_tables + g_idx


def activation_workspace_bytes(cfg: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int,
                               max_num_seqs: int) -> int:
    """Peak transient memory of one step beyond weights and KV (an estimate, not a measurement).

    Per batched token, in `dtype`: the residual and its normed copy (2 x hidden), the fused q/k/v
    output, the attention output (q_size) and the fused gate/up output plus its activated half
    (3 x intermediate). Per sampled sequence: float32 logits and their softmax (2 x vocab x 4).
    An MoE layer's k routed rows per token instead: each row's gathered input and output (2 x hidden), its
    gate/up output and activated half (3 x moe_intermediate); the larger of the two kinds of layer counts.
    """
    mlp = 3 * cfg.intermediate_size if len(cfg.moe_dense_layers) or not cfg.is_moe else 0
    if cfg.is_moe:
        mlp = max(mlp, cfg.num_experts_per_tok * (2 * cfg.hidden_size + 3 * cfg.moe_intermediate_size))
    per_token = 2 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + cfg.q_size + mlp
    return max_num_batched_tokens * per_token * dtype_bytes(dtype) + max_num_seqs * logits_bytes_per_seq(cfg)


def logits_bytes_per_seq(cfg: ModelConfig) -> int:
    return 2 * cfg.vocab_size * 4


# Mixture-of-experts figures (kv/expert_bytes.py's docstring has the arithmetic).
def num_parameters(cfg: ModelConfig) -> int:
    """Every weight the model holds (a tied lm_head counted once)."""
    return weight_bytes(cfg, torch.float32) // 4


def num_active_parameters(cfg: ModelConfig) -> int:
    """The weights one token runs through: all but the routed experts it is not sent to."""
    inactive = cfg.num_experts - cfg.num_experts_per_tok
    return num_parameters(cfg) - num_moe_layers(cfg) * inactive * expert_parameters(cfg)


def expected_experts_touched(cfg: ModelConfig, batch: int) -> float:
    """Distinct experts of one MoE layer that `batch` tokens reach, in expectation under uniform routing."""
    if not cfg.is_moe:
        return 0.0
    return cfg.num_experts * (1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** batch)


def decode_weight_bytes(cfg: ModelConfig, dtype: torch.dtype, batch: int, quantization: str = "none",
                        declared=None, int_calibration: str = EngineConfig.int_calibration) -> int:
    """Weight bytes one decode step of `batch` sequences reads (see the module docstring); a dense model's
    step reads all of them."""
    total = weight_bytes(cfg, dtype, quantization, declared=declared, int_calibration=int_calibration)
    if not cfg.is_moe:
        return total
    untouched = cfg.num_experts - expected_experts_touched(cfg, batch)
    return int(total - num_moe_layers(cfg) * untouched * expert_bytes(cfg, dtype_bytes(dtype),
                                                                     is_fp8_experts(cfg, quantization)))


def is_fp8_experts(cfg: ModelConfig, quantization: str) -> bool:
    """Whether FP8 at load holds the routed experts as E4M3 (quant/fp8_experts.py): under `quantization`
    fp8, MXFP4 experts included (they are dequantized at load first)."""
    return quantization == "fp8" and cfg.is_moe


@dataclass(frozen=True)
class CapacityPlan:
    """Memory for `concurrency` requests of `max_model_len` tokens each; sizes in bytes."""

    dtype: torch.dtype
    quantization: str
    max_model_len: int
    concurrency: int
    block_size: int
    max_num_batched_tokens: int
    weight_bytes: int
    kv_bytes_per_token: int
    step_activation_bytes: int  # activations of max_num_batched_tokens, without the logits
    logits_bytes_per_seq: int
    memory_bytes: int | None = None  # the device memory to fit into, when given
    kv_dtype: torch.dtype | None = None  # what the KV cache stores (engine.kv_cache_dtype); None: dtype
    # Tensor parallelism: every size above is one GPU's, that of the rank holding the most (its
    # weights, its KV heads' bytes per token, its activations; rank 0 gathers the whole logits).
    tensor_parallel_size: int = 1
    # The whole model's parameters and those one token runs through (equal in a dense model; MoE: a token
    # reads its top-k experts only, kv/expert_bytes.py), and the weight bytes one decode step reads on one
    # GPU at 1 sequence and at `concurrency` (the decode bandwidth estimate: bytes / bandwidth = seconds).
    num_parameters: int = 0
    num_active_parameters: int = 0
    decode_weight_bytes_one: int = 0
    decode_weight_bytes_batch: int = 0
    # Sliding-window layers in their own block group (kv/window_groups.py): how many, their widest window and
    # their share of kv_bytes_per_token. 0: none, or their windows are masks over a full-length cache.
    num_local_layers: int = 0
    local_window: int = 0
    local_kv_bytes_per_token: int = 0

    @property
    def kv_tokens_per_request(self) -> int:
        """A request's context rounded up to whole blocks: what the paged pool reserves for it."""
        return -(-self.max_model_len // self.block_size) * self.block_size

    @property
    def local_kv_tokens_per_request(self) -> int:
        """Positions a request's sliding-window layers keep: the blocks of its window (W / block_size + 1 at
        most), or its whole context when shorter."""
        if not self.num_local_layers:
            return self.kv_tokens_per_request
        return min(self.kv_tokens_per_request, max_local_blocks(self.local_window, self.block_size) * self.block_size)

    @property
    def kv_bytes_per_request(self) -> int:
        """The global layers' bytes at the full context plus the local layers' over their window."""
        global_bytes = self.kv_bytes_per_token - self.local_kv_bytes_per_token
        return global_bytes * self.kv_tokens_per_request + self.local_kv_bytes_per_token * self.local_kv_tokens_per_request

    @property
    def local_step_reserve_bytes(self) -> int:
        """The local layers' blocks for one step's prefill chunks (freed at the next step), beyond the windows."""
        if not self.num_local_layers:
            return 0
        tokens = local_step_reserve_blocks(self.max_num_batched_tokens, self.block_size) * self.block_size
        return self.local_kv_bytes_per_token * tokens

    @property
    def kv_bytes(self) -> int:
        return self.concurrency * self.kv_bytes_per_request + self.local_step_reserve_bytes

    @property
    def activation_bytes(self) -> int:
        return self.step_activation_bytes + self.concurrency * self.logits_bytes_per_seq

    @property
    def total_bytes_before_margin(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def fragmentation_bytes(self) -> int:
        return int(KV_FRAGMENTATION_FRACTION * self.kv_bytes)

    @property
    def margin_bytes(self) -> int:
        return self.fragmentation_bytes + self.activation_bytes

    @property
    def total_bytes(self) -> int:
        return self.total_bytes_before_margin + self.margin_bytes

    @property
    def fits(self) -> bool | None:
        """`concurrency` requests of max_model_len fit memory_bytes (None: no memory given)."""
        return None if self.memory_bytes is None else self.max_concurrency >= self.concurrency

    @property
    def max_concurrency(self) -> int | None:
        """The most requests of max_model_len whose total with margin fits memory_bytes."""
        if self.memory_bytes is None:
            return None
        room = (self.memory_bytes - self.weight_bytes - self.step_activation_bytes
                - self.local_step_reserve_bytes * (1 + KV_FRAGMENTATION_FRACTION))
        per_request = self.kv_bytes_per_request * (1 + KV_FRAGMENTATION_FRACTION) + self.logits_bytes_per_seq
        return max(0, int(room // per_request))

    def to_dict(self) -> dict:
        names = ("tensor_parallel_size", "max_model_len", "concurrency", "block_size", "max_num_batched_tokens",
                 "weight_bytes",
                 "kv_bytes_per_token", "kv_tokens_per_request", "kv_bytes_per_request", "kv_bytes",
                 "total_bytes_before_margin", "fragmentation_bytes", "activation_bytes", "margin_bytes",
                 "total_bytes", "memory_bytes", "max_concurrency", "fits", "num_parameters",
                 "num_active_parameters", "decode_weight_bytes_one", "decode_weight_bytes_batch",
                 "num_local_layers", "local_window", "local_kv_bytes_per_token", "local_kv_tokens_per_request",
                 "local_step_reserve_bytes")
        return {"dtype": str(self.dtype).removeprefix("torch."), "quantization": self.quantization,
                "kv_cache_dtype": str(self.kv_dtype or self.dtype).removeprefix("torch."),
                **{name: getattr(self, name) for name in names}}


def plan_capacity(cfg: ModelConfig, dtype: torch.dtype, max_model_len: int, concurrency: int = 1,
                  quantization: str = "none", memory_bytes: int | None = None, block_size: int = 16,
                  max_num_batched_tokens: int = 4096, quantize_lm_head: bool = False,
                  declared=None, kv_dtype: torch.dtype | None = None,
                  int_calibration: str = EngineConfig.int_calibration, tensor_parallel_size: int = 1) -> CapacityPlan:
    """The capacity arithmetic `batchgen plan` prints; KV per token is the pool's own kv_bytes_per_token
    (kv_dtype: the KV cache's dtype, e.g. FP8; None: the model dtype); `declared`: a folder's declared
    quantization_config (its integer layout decides the weight bytes). With `tensor_parallel_size` N,
    one GPU's share: the same arithmetic on each rank's shapes (engine/parallel/layout.py), the
    largest rank's figures (ValueError when the model cannot split over N)."""
    from batchgen.engine.parallel.layout import all_layouts

    ranks = [layout.rank_config(cfg) for layout in all_layouts(cfg, tensor_parallel_size)]
    # Sliding-window layers with their own block group hold only their window (as the engine does on its
    # default backends): their bytes per token (one rank's), priced over the window.
    group = window_group([cfg.layer_sliding_window(i) for i in range(cfg.num_layers)])
    local_layers, local_window = group if group is not None else ((), 0)
    rank_kv = max(kv_bytes_per_token(rank, kv_dtype or dtype) for rank in ranks)
    local_kv = rank_kv * len(local_layers) // cfg.num_layers
    return CapacityPlan(
        dtype=dtype, quantization=quantization, max_model_len=max_model_len, concurrency=concurrency,
        block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
        weight_bytes=max(weight_bytes(rank, dtype, quantization, quantize_lm_head, declared, int_calibration)
                         for rank in ranks),
        kv_bytes_per_token=rank_kv,
        step_activation_bytes=max(activation_workspace_bytes(rank, dtype, max_num_batched_tokens, 0)
                                  for rank in ranks),
        logits_bytes_per_seq=logits_bytes_per_seq(cfg), memory_bytes=memory_bytes, kv_dtype=kv_dtype,
        tensor_parallel_size=tensor_parallel_size, num_parameters=num_parameters(cfg),
        num_active_parameters=num_active_parameters(cfg),
        decode_weight_bytes_one=max(decode_weight_bytes(rank, dtype, 1, quantization, declared, int_calibration) for rank in ranks),
        decode_weight_bytes_batch=max(decode_weight_bytes(rank, dtype, concurrency, quantization, declared, int_calibration)
                                      for rank in ranks),
        num_local_layers=len(local_layers), local_window=local_window, local_kv_bytes_per_token=local_kv)

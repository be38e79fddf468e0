"""Which implementation runs on this device: decided once when the model loads, in one object.

The engine has a fast path and a plain-torch path for several pieces (attention, the elementwise
ops, the greedy pick, the linear layers, FP8 matmuls); which one runs depends on the device, the
dtype, the torch build and whether the C kernels compiled. `detect_capabilities` asks each of
those questions once; the loader builds the model from the answer, the runner and sampler take
their flags from it, and `LLMEngine.stats["kernels"]` and the job's `_SUCCESS` report it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from batchgen.engine.attention.selector import select_attention_backend
from batchgen.engine.config import EngineConfig
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.cpu_linear import can_fuse_silu_mul, can_pack
from batchgen.engine.quant.fp8 import fp8_matmul_path, has_fp8_tensor_cores
from batchgen.kernels import cpu_elementwise, cpu_sampling

log = logging.getLogger("batchgen.engine")


@dataclass(frozen=True)
class Capabilities:
    """What runs, for one loaded model. Reported as `as_dict()`."""

    device: str  # cpu | cuda
    attention_backend: str  # a module of engine/attention/: cpu | sdpa | triton
    elementwise_ops: str  # residual add + RMSNorm, rotary, SiLU * up: c (fused C kernels) | compiled | eager
    is_c_sampling: bool  # greedy pick and log Z in one C pass per row
    is_onednn_packed_linear: bool  # float32 linear layers prepacked for oneDNN (CPU)
    is_onednn_silu_mul: bool  # the MLP's SiLU(gate) * up in the packed GEMMs' epilogues
    has_triton: bool  # Triton imports and the device is CUDA
    has_fp8_matmul: bool  # FP8 tensor cores for torch._scaled_mm (CUDA, compute capability >= 8.9)
    fp8_mode: str | None  # w8a8 | w8a16 when the model has FP8 layers, else None
    is_triton_fp8_w8a16: bool  # w8a16 through the Triton kernel (it passed its probe here)
    fp8_reason: str = dataclasses.field(default="", compare=False)  # why that fp8_mode (for the log)

    def as_dict(self) -> dict:
        """The report: every field but the log-only fp8_reason."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}

    def describe(self) -> str:
        return ", ".join(f"{name} {value}" for name, value in self.as_dict().items())


def detect_capabilities(config: EngineConfig, model_cfg: ModelConfig, *, has_fp8_layers: bool) -> Capabilities:
    """Decide every implementation choice for `config` on this machine; logs the outcome once.

    `has_fp8_layers`: the model will hold FP8 linears (quantized at load or read from a checkpoint).
    Raises ValueError when a requested choice cannot run here (an attention backend, fp8_mode w8a8
    on a GPU without FP8 tensor cores).
    """
    device, dtype = config.torch_device, config.torch_dtype
    backend = select_attention_backend(config.attention_backend, device, dtype, model_cfg.head_dim,
                                       is_fp8_kv=config.kv_cache_dtype != "auto")
    if config.compile:
        elementwise_ops = "compiled"
    elif device.type == "cpu" and dtype == torch.float32 and cpu_elementwise.is_available():
        elementwise_ops = "c"
    else:
        elementwise_ops = "eager"
    # The model hands the sampler float32 logits on its own device.
    is_c_sampling = device.type == "cpu" and cpu_sampling.is_available()
    is_packed = can_pack(device, dtype)
    fp8_mode, fp8_reason, is_triton_fp8_w8a16 = fp8_matmul_path(config) if has_fp8_layers else (None, "", False)
    capabilities = Capabilities(
        device=device.type, attention_backend=backend.name, elementwise_ops=elementwise_ops,
        is_c_sampling=is_c_sampling, is_onednn_packed_linear=is_packed,
        is_onednn_silu_mul=is_packed and can_fuse_silu_mul(), has_triton=_has_triton(device),
        has_fp8_matmul=has_fp8_tensor_cores(device), fp8_mode=fp8_mode, is_triton_fp8_w8a16=is_triton_fp8_w8a16,
        fp8_reason=fp8_reason)
    log.info("kernels: %s", capabilities.describe())
    return capabilities


def _has_triton(device: torch.device) -> bool:
    if device.type != "cuda":
        return False  # the engine runs no Triton kernel off CUDA
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

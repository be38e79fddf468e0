"""Which implementation runs on this device: decided once when the model loads, in one object.

The engine has a fast path and a plain-torch path for several pieces (attention, the elementwise
ops, the greedy pick, the linear layers, FP8 matmuls); which one runs depends on the device, the
dtype, the CPU's instruction set, the torch build and whether the C kernels compiled.
`detect_capabilities` asks each of those questions once; the loader builds the model from the
answer, the runner and sampler take their flags from it, and `LLMEngine.stats["kernels"]` and the
job's `_SUCCESS` report it.

bfloat16 on the CPU runs one of two ways (`bf16_path`):
- `bf16_units`: the CPU has BF16 dot-product units (AVX-512 BF16 or AMX) and oneDNN's bf16 GEMMs
  use them: weights and activations in bfloat16, GEMMs on packed bf16 weights, the C kernels
  reading and writing bfloat16 rows (float32 inside), the KV cache in bfloat16;
- `widened`: no BF16 units (AVX2, AVX-512 without BF16): weights and KV cache stored in bfloat16
  (half the memory and the bytes streamed), activations float32; each GEMM widens its bf16 weight to
  float32 (engine/models/bf16_linear.py) and the attention kernels widen the cache by a shift.
Without the C kernels bfloat16 runs as plain torch does it (eager ops, SDPA).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from batchgen.engine.attention.selector import select_attention_backend
from batchgen.engine.config import EngineConfig
from batchgen.engine.cpu_dtype import auto_cpu_dtype
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.cpu_linear import can_fuse_silu_mul, can_pack
from batchgen.engine.quant.fp8 import fp8_matmul_path, has_fp8_tensor_cores
from batchgen.kernels import cpu_elementwise, cpu_isa, cpu_kv_store, cpu_paged_attention, cpu_sampling

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
    cpu_isa: str | None = None  # CPU: avx2 | avx512 | avx512_bf16 | amx (kernels/cpu_isa.py); None on CUDA
    has_bf16_units: bool = False  # the CPU (at cpu_isa) has BF16 dot-product units
    bf16_path: str | None = None  # CPU bfloat16: bf16_units | widened | eager (see above); None otherwise
    compute_dtype: str = "float32"  # what activations and GEMM inputs are: bfloat16 only on the bf16_units path
    fp8_reason: str = dataclasses.field(default="", compare=False)  # why that fp8_mode (for the log)

    def as_dict(self) -> dict:
        """The report: every field but the log-only fp8_reason."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}

    def describe(self) -> str:
        return ", ".join(f"{name} {value}" for name, value in self.as_dict().items())


def detect_capabilities(config: EngineConfig, model_cfg: ModelConfig, *, has_fp8_layers: bool,
                        has_float_weights: bool = True) -> Capabilities:
    """Decide every implementation choice for `config` on this machine; logs the outcome once.

    `has_fp8_layers`: the model will hold FP8 linears (quantized at load or read from a checkpoint);
    `has_float_weights`: every linear is a plain float layer (no FP8 or integer layers).
    Raises ValueError when a requested choice cannot run here (an attention backend, fp8_mode w8a8
    on a GPU without FP8 tensor cores).
    """
    device, dtype = config.torch_device, config.torch_dtype
    isa = cpu_isa.selected_isa() if device.type == "cpu" else None
    has_bf16_units = isa is not None and cpu_isa.has_bf16_units(isa)
    bf16_path = None
    if device.type == "cpu" and dtype == torch.bfloat16:
        bf16_path = cpu_bf16_path(config, has_bf16_units) if has_float_weights and not has_fp8_layers else "eager"
    compute_dtype = torch.float32 if bf16_path == "widened" else dtype  # activations and GEMM inputs
    backend = select_attention_backend(config.attention_backend, device, compute_dtype, model_cfg.head_dim,
                                       is_fp8_kv=config.kv_cache_dtype != "auto")
    if config.compile:
        elementwise_ops = "compiled"
    elif (device.type == "cpu" and compute_dtype in (torch.float32, torch.bfloat16) and bf16_path != "eager"
          and cpu_elementwise.is_available()):
        elementwise_ops = "c"
    else:
        elementwise_ops = "eager"
    # The model hands the sampler float32 logits on its own device.
    is_c_sampling = device.type == "cpu" and cpu_sampling.is_available()
    # The widened path's linears widen their own bf16 weights (no oneDNN packing of a float32 copy).
    is_packed = bf16_path != "widened" and can_pack(device, compute_dtype)
    fp8_mode, fp8_reason, is_triton_fp8_w8a16 = fp8_matmul_path(config) if has_fp8_layers else (None, "", False)
    capabilities = Capabilities(
        device=device.type, attention_backend=backend.name, elementwise_ops=elementwise_ops,
        is_c_sampling=is_c_sampling, is_onednn_packed_linear=is_packed,
        is_onednn_silu_mul=is_packed and can_fuse_silu_mul(compute_dtype), has_triton=_has_triton(device),
        has_fp8_matmul=has_fp8_tensor_cores(device), fp8_mode=fp8_mode, is_triton_fp8_w8a16=is_triton_fp8_w8a16,
        cpu_isa=isa, has_bf16_units=has_bf16_units, bf16_path=bf16_path,
        compute_dtype=str(compute_dtype).removeprefix("torch."), fp8_reason=fp8_reason)
    # debug: the run's summary and the engine's stats report the same line once, not at start-up too
    log.debug("kernels: %s", capabilities.describe())
    return capabilities


def cpu_bf16_path(config: EngineConfig, has_bf16_units: bool) -> str:
    """How bfloat16 runs on this CPU with float weights (module docstring): bf16_units where the CPU
    has them and oneDNN packs bf16 weights; widened where the C attention kernels can read a bfloat16
    cache; else eager (also when another attention backend is asked for)."""
    if config.attention_backend not in ("auto", "cpu", "torch"):
        return "eager"
    if not (cpu_paged_attention.is_available() and cpu_kv_store.is_available()):
        return "eager"
    if has_bf16_units and can_pack(torch.device("cpu"), torch.bfloat16):
        return "bf16_units"
    return "widened"


def _has_triton(device: torch.device) -> bool:
    if device.type != "cuda":
        return False  # the engine runs no Triton kernel off CUDA
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_report() -> dict:
    """This CPU as the engine sees it (`batchgen plan` prints it): the ISA level the kernels run at,
    whether bfloat16 runs on BF16 units, and what `dtype: auto` picks for the CPU here."""
    try:
        isa = cpu_isa.selected_isa()
    except ValueError as exc:
        return {"cpu_isa": None, "has_bf16_units": False, "auto_dtype": "float32", "problem": str(exc)}
    return {"cpu_isa": isa, "has_bf16_units": cpu_isa.has_bf16_units(isa),
            "auto_dtype": str(auto_cpu_dtype()).removeprefix("torch.")}

"""The engine's one typed config, passed whole (keywords = the job file's `model` and `engine` keys)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_size(value: str | int | float) -> int | float:
    """'8GiB' -> bytes (int); a float in (0, 1] -> that fraction (float); an int -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"memory size must be bytes, a size like '8GiB' or a fraction, got {value!r}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and 0 < value <= 1:
            return value
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read memory size {value!r}: use bytes, '8GiB', '500MB' or a fraction like 0.9")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "" and 0 < number <= 1 and "." in match.group(1):
        return number
    return int(number * _SIZE_UNITS[unit])


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know, resolved once. Derived values are properties."""

    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "none"  # none | fp8
    fp8_mode: str = "auto"  # auto | w8a8 | w8a16
    quantize_lm_head: bool = False
    max_model_len: int | None = None  # None: the model's own context length
    device: str = "auto"  # auto | cpu | cuda[:N]
    attention_backend: str = "auto"  # auto | torch | triton
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    kv_cache_memory: str | int | float = "auto"
    num_kv_blocks: int | None = None  # override the pool size (tests, capacity experiments)
    num_threads: int | None = None  # CPU threads for torch; None: leave torch's default
    compile: bool = False  # torch.compile the elementwise ops (measured: no gain on the 2-core CPU)

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, ["auto", *_DTYPES])
        _check_choice("quantization", self.quantization, ["none", "fp8"])
        _check_choice("fp8_mode", self.fp8_mode, ["auto", "w8a8", "w8a16"])
        _check_choice("attention_backend", self.attention_backend, ["auto", "cpu", "sdpa", "torch"])
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be one of auto, cpu, cuda, cuda:N; got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory != "auto":
            parse_memory_size(self.kv_cache_memory)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def resolved_attention_backend(self) -> str:
        # The Triton attention kernels are a later issue; until then torch everywhere.
        return "torch" if self.attention_backend == "auto" else self.attention_backend

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: str, allowed: list[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")

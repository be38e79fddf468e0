"""The engine's one typed config, passed whole, and the checks every setting goes through.

EngineConfig's fields own the names, defaults and allowed values of the job file's `model` and
`engine` keys: the job schema is derived from them (pipeline/job_settings.py says which field sits
in which section and where a job's default deliberately differs).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # the one table
DTYPE_CHOICES = ("auto", *DTYPES)
# engine/quant/methods.py says what each means and how auto resolves against a checkpoint.
QUANTIZATIONS = ("auto", "none", "fp8", "int8", "int4", "gptq", "awq", "compressed-tensors", "gguf")
FP8_MODES = ("auto", "w8a8", "w8a16")
INT_CALIBRATIONS = ("activation_aware", "none")
# Names only: the attention selector resolves them at engine start (torch, kept for older job files:
# cpu on the CPU, triton on CUDA).
ATTENTION_BACKENDS = ("auto", "cpu", "sdpa", "triton", "torch")
# vLLM's names: auto = the model dtype; fp8 = fp8_e4m3 (float8_e4m3fn); fp8_e5m2 (float8_e5m2).
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class SettingError(ValueError):
    """A setting outside its allowed values: `name` is the field, `rule` says what is allowed.

    The job file turns it into `section.name: rule (got value)`; from Python it reads
    `Owner.name rule; got value`.
    """

    def __init__(self, owner: str, name: str, rule: str, value: Any):
        super().__init__(f"{owner}.{name} {rule}; got {value!r}")
        self.name, self.rule, self.value = name, rule, value


def check_settings(obj: Any, checks: list[tuple[str, bool, str]]) -> None:
    """Raise SettingError for the first (field name, is ok, rule) that is not ok."""
    for name, is_ok, rule in checks:
        if not is_ok:
            raise SettingError(type(obj).__name__, name, rule, getattr(obj, name))


def _one_of(name: str, value: Any, choices: tuple[str, ...]) -> tuple[str, bool, str]:
    return name, value in choices, f"must be one of {', '.join(choices)}"


def parse_memory_size(value: str | int | float) -> int | float:
    """'8GiB' -> bytes (int); a float in (0, 1] -> that fraction (float); an int -> bytes."""
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
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


def is_memory_size(value: Any) -> bool:
    try:
        parse_memory_size(value)
    except (ValueError, TypeError):
        return False
    return True


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Measured on this repository's 2-core CPU with the bundled model
# (docs/benchmarks/history/speculative-decoding.md, "Speculative decoding"): a 5-token verify costs 1.2x a
# decode at 1-2 running sequences, 1.6x at 4, 2.6x at 8, 3.6x at 32, so above 4 it pays only where drafts are
# accepted far more often than copy prompts get.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """`engine.speculative` (vLLM's speculative_config names). It changes no output: every emitted
    token is the one plain decoding picks, so it stays out of the job's config hash.
    """

    method: str = "ngram"
    """ngram (drafts copied from the prompt and output so far) | draft_model (a smaller model's)."""
    num_speculative_tokens: int = 4
    """Draft tokens proposed per step and verified together (1 to 16)."""
    prompt_lookup_min: int = 1
    """ngram: the shortest suffix matched against earlier text."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix matched against earlier text."""
    model: str | None = None
    """draft_model: the draft model (a path like model.path); null with ngram."""
    quantization: str | None = None
    """draft_model: the draft's quantization (e.g. fp8: the target's own weights, perturbed); null: none."""
    disable_by_batch_size: int | None = None
    """Speculate only in steps whose running batch is at most this; null: the measured default."""

    def __post_init__(self) -> None:
        check_settings(self, [
            _one_of("method", self.method, SPECULATIVE_METHODS),
            ("num_speculative_tokens", isinstance(self.num_speculative_tokens, int)
             and 1 <= self.num_speculative_tokens <= 16, "must be in [1, 16]"),
            ("prompt_lookup_min", self.prompt_lookup_min >= 1, "must be >= 1"),
            ("prompt_lookup_max", self.prompt_lookup_max >= self.prompt_lookup_min,
             "must be >= prompt_lookup_min"),
            ("model", (self.model is not None) == (self.method == "draft_model"),
             "must name the draft model with method draft_model, and be null with ngram"),
            _one_of("quantization", self.quantization or "none", QUANTIZATIONS),
            ("disable_by_batch_size", self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
             "must be >= 1 or null"),
        ])

    @property
    def max_batch_size(self) -> int:
        """The largest running batch that speculates."""
        return self.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE


def as_speculative_config(value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
    """The settings from a mapping (job file, LLM(...) keyword) or as given."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise SettingError("EngineConfig", "speculative", "must be a mapping or null", value)
    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise SettingError("EngineConfig", "speculative", f"has unknown key(s) {', '.join(unknown)}; "
                           f"allowed: {', '.join(sorted(names))}", value)
    return SpeculativeConfig(**value)


def _parser_name(name: str, value: str | None) -> tuple[str, bool, str]:
    """A reasoning or tool-call parser's name is null or a registered one (the rule lists them)."""
    if name == "reasoning_parser":
        from batchgen.engine.text.reasoning import reasoning_parser_names as names
    else:
        from batchgen.engine.text.tool_parsers import tool_parser_names as names
    return name, value is None or value in names(), f"must be null or one of {', '.join(names())}"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know, resolved once. Derived values are properties."""

    model: str
    """The model: a bundled alias, a Hugging Face folder, a `.gguf` file, a Hugging Face repo id or an
    fsspec URI (the job file's `model.path`)."""
    revision: str | None = None
    """A Hugging Face repo id's branch, tag or commit (vLLM's name); null: main. Only for repo ids."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16. auto: bfloat16 on a GPU; on the CPU bfloat16 where it has
    BF16 units (AVX-512 BF16, AMX), else float32."""
    quantization: str = "auto"
    """auto | none | fp8 | int8 | int4 | gptq | awq | compressed-tensors | gguf. auto: the format a
    folder declares (quantization_config), else none; fp8 / int8 / int4 quantize at load; gguf keeps a
    GGUF file's blocks quantized."""
    fp8_mode: str = "auto"
    """auto | w8a8 | w8a16: FP8 weights with FP8 activations (torch._scaled_mm, dynamic per-token
    scales) or weight-only. auto: w8a8 on GPUs with FP8 matmul, w8a16 elsewhere."""
    quantize_lm_head: bool = False
    """With fp8 / int8 / int4: quantize lm_head too (otherwise the logits' last matmul stays in dtype)."""
    int_calibration: str = "activation_aware"
    """int8 / int4 at load: activation_aware (AWQ-style scales; int4 also a block Hadamard rotation and
    clipping; searched on the bundled calibration text) | none (round to nearest from each row's or
    group's range)."""
    max_model_len: int | None = None
    """Tokens per request at most, prompt and completion together; null: the model's own context length."""
    generation_config: str = "auto"
    """Sampling defaults from a generation_config.json (vLLM's name and values): auto (the model
    folder's), vllm (none: SamplingParams' own), or a folder holding one."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N. auto: cuda when a GPU is visible, else cpu."""
    attention_backend: str = "auto"
    """auto | cpu | sdpa | triton | torch. auto: triton on CUDA, cpu (the C kernels) on the CPU; torch,
    kept for older job files: cpu on the CPU, sdpa elsewhere."""
    kv_cache_dtype: str = "auto"
    """auto | fp8 | fp8_e4m3 | fp8_e5m2 (vLLM's names): auto stores the model dtype; fp8 is fp8_e4m3,
    one byte per value with one scale per layer for K and V."""
    calculate_kv_scales: bool = False
    """FP8 KV cache: per-layer K/V scales from the first step's absolute maxima (false: scale 1.0 or
    the checkpoint's)."""
    block_size: int = 16
    """Tokens per KV cache block (the unit of prefix caching and allocation)."""
    max_num_seqs: int = 128
    """Sequences running at once at most (each step's sequence cap)."""
    max_num_batched_tokens: int = 4096
    """Tokens one step processes at most (decodes and prefill chunks together)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a prefix already in memory (full blocks, matched by a chained hash)."""
    kv_cache_memory: str | int | float = "auto"
    """The KV pool's size: auto, bytes, a size such as '8GiB' or '500MB', or a fraction in (0, 1] of
    free device memory. auto: gpu_memory_utilization x GPU memory less the weights and the profiled
    step on a GPU. On the CPU (every byte resident): what can run at once, max_num_seqs sequences of
    max_model_len tokens x the bytes per token that `batchgen plan` prints, fewer for a job (its input
    rows x n sequences, its longest prompt + max_tokens tokens), at least one max_model_len sequence,
    at most the smaller of 4 GiB and 20% of RAM; a draft model's pool shares it. `batchgen plan JOB`,
    the run's log and its summary state the size (docs/guides/cpu.md#sizing-the-kv-cache)."""
    gpu_memory_utilization: float = 0.9
    """CUDA: the share of the GPU's total memory this engine may fill with weights, activations and KV
    (vLLM's name); the KV pool gets what the profiled step leaves. kv_cache_memory, when set, wins."""
    enforce_eager: bool = False
    """CUDA: run decode steps eagerly, without CUDA graphs (vLLM's name)."""
    max_cuda_graph_size: int | None = None
    """CUDA: decode batches of up to this many sequences replay a captured graph (null: max_num_seqs);
    larger ones run eagerly. Fewer graphs start faster and hold less memory (vLLM's
    max_cudagraph_capture_size)."""
    async_scheduling: bool | None = None
    """Prepare step N+1 while the device runs step N (vLLM's async scheduling): null = on with CUDA,
    off on the CPU; true/false force it. Outputs are the same either way. Steps run in order while a
    request needs each step's tokens on the host first (structured output, beam search, prompt
    log-probabilities still to compute, scoring), and always with speculative decoding or
    tensor_parallel_size > 1. A request that stops (EOS, stop) costs one more step's row, dropped."""
    num_kv_blocks: int | None = None
    """The KV pool's size in blocks, overriding kv_cache_memory (tests, capacity experiments); null: sized
    from memory."""
    num_threads: int | None = None
    """CPU threads for torch; null: leave torch's default (OMP_NUM_THREADS)."""
    compile: bool = False
    """torch.compile the elementwise ops (measured: no gain on the 2-core CPU)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's speculative_config): a mapping of SpeculativeConfig's keys; null: off.
    It changes no output."""
    seed: int | None = None
    """Keys the draws of requests that carry no seed of their own (vLLM's name): LLM calls and a
    server's requests are then reproducible across restarts. null: LLM keys them by its request
    counter, the server by a random key per request."""
    tensor_parallel_size: int = 1
    """One model over N ranks (vLLM's name): this process is rank 0, N - 1 worker processes hold the
    other shards; NCCL between GPUs cuda:0..N-1, gloo between CPU processes."""
    reasoning_parser: str | None = None
    """How outputs split the model's thinking from its answer (vLLM's --reasoning-parser): deepseek_r1 |
    qwen3 (engine/text/reasoning.py); null: outputs are not split. Needed by thinking_token_budget."""
    tool_call_parser: str | None = None
    """How tool calls are read from outputs and written when forced (vLLM's --tool-call-parser): hermes |
    llama3_json | mistral (engine/text/tool_parsers.py); null: tool calls are not parsed."""
    runner: str = "auto"
    """vLLM's name: generate (a causal LM samples tokens) or pooling (a `*ForSequenceClassification`
    model scores its input: LLM.classify / reward / encode, task: reward); auto: pooling for a sequence
    classifier's checkpoint, generate otherwise. A model without the head the runner needs is refused."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT folders) over the base model (vLLM's name): requests name one
    (LoRARequest) and rows of different adapters and of the base run in the same step."""
    max_loras: int = 1
    """Distinct adapters in one step at most (vLLM's name): the scheduler admits no request whose
    adapter would be one more; each has a slot of stacked weights on the device."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have (vLLM's name; sizes the device slots)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory at most, least recently used evicted and read again when
    asked (vLLM's name); null: max_loras."""
    merged_lora: str | None = None
    """A PEFT LoRA adapter (folder or Hugging Face repo id) merged into the weights at load, before they
    are quantized or packed: every request runs the fine-tune at the base model's speed, and a
    LoRARequest with this lora_path runs the same (a job whose one adapter runs every row sets it).
    Where the adapter targets layers quantized in the checkpoint (GPTQ/AWQ, FP8, GGUF blocks) it runs
    unmerged on every request instead. null: none; cannot be combined with enable_lora."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", as_speculative_config(self.speculative))
        check_settings(self, [
            _one_of("dtype", self.dtype, DTYPE_CHOICES),
            _one_of("quantization", self.quantization, QUANTIZATIONS),
            _one_of("fp8_mode", self.fp8_mode, FP8_MODES),
            _one_of("int_calibration", self.int_calibration, INT_CALIBRATIONS),
            ("revision", self.revision is None or (isinstance(self.revision, str) and self.revision.strip() != ""),
             "must be a branch, tag or commit name, or null"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2, "must be >= 2 or null"),
            ("generation_config", isinstance(self.generation_config, str) and self.generation_config.strip() != "",
             "must be auto, vllm or a folder holding a generation_config.json"),
            ("device", isinstance(self.device, str) and _DEVICE.fullmatch(self.device) is not None,
             "must be one of auto, cpu, cuda, cuda:N"),
            _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS),
            _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES),
            ("block_size", self.block_size >= 1, "must be >= 1"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "must be >= 1"),
            ("kv_cache_memory", self.kv_cache_memory == "auto" or is_memory_size(self.kv_cache_memory),
             "must be auto, bytes, a size such as '8GiB' or '500MB', or a fraction in (0, 1] like 0.9"),
            ("gpu_memory_utilization", isinstance(self.gpu_memory_utilization, (int, float))
             and not isinstance(self.gpu_memory_utilization, bool) and 0 < self.gpu_memory_utilization <= 1,
             "must be a fraction in (0, 1]"),
            ("max_cuda_graph_size", self.max_cuda_graph_size is None or self.max_cuda_graph_size >= 1,
             "must be >= 1 or null"),
            ("async_scheduling", self.async_scheduling is None or isinstance(self.async_scheduling, bool),
             "must be true, false or null"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1, "must be >= 1 or None"),
            ("num_threads", self.num_threads is None or self.num_threads >= 1, "must be >= 1 or None"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
             "must be an integer or null"),
            ("tensor_parallel_size", isinstance(self.tensor_parallel_size, int)
             and not isinstance(self.tensor_parallel_size, bool) and self.tensor_parallel_size >= 1, "must be >= 1"),
            _parser_name("reasoning_parser", self.reasoning_parser),
            _parser_name("tool_call_parser", self.tool_call_parser),
            _one_of("runner", self.runner, RUNNERS),
            ("max_loras", isinstance(self.max_loras, int) and self.max_loras >= 1, "must be >= 1"),
            ("max_lora_rank", isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1, "must be >= 1"),
            ("max_cpu_loras", self.max_cpu_loras is None or (isinstance(self.max_cpu_loras, int)
             and self.max_cpu_loras >= self.max_loras), "must be >= max_loras or null"),
            ("enable_lora", not self.enable_lora or self.tensor_parallel_size == 1,
             "is not implemented with tensor_parallel_size > 1"),
            ("merged_lora", self.merged_lora is None or (isinstance(self.merged_lora, str)
             and self.merged_lora.strip() != "" and not self.enable_lora and self.tensor_parallel_size == 1),
             "must be an adapter's folder or repo id, or null; it cannot be combined with enable_lora "
             "or tensor_parallel_size > 1"),
        ])

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            if self.torch_device.type == "cuda":
                return torch.bfloat16
            # Imported here: asking the CPU loads the kernels and oneDNN's probe, which only a CPU engine
            # with dtype auto needs (configs are also built where no engine runs: job checks, `--help`).
            from batchgen.engine.cpu_dtype import auto_cpu_dtype

            return auto_cpu_dtype()
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model dtype, or an FP8 format (one fp32 scale per layer for K and V)."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def is_async_scheduling(self) -> bool:
        """Whether steps may be launched one ahead. Never with speculative decoding (its drafts come from
        each step's tokens on the host) or tensor parallelism (the workers get each step's inputs from
        the host, before the device could fill in the previous step's tokens), nor with LoRA adapters (a
        step may load an adapter into the slot the step in flight reads)."""
        if self.speculative is not None or self.tensor_parallel_size > 1 or self.enable_lora:
            return False
        if self.async_scheduling is None:
            return self.torch_device.type == "cuda"
        return self.async_scheduling

    @property
    def num_cuda_graph_seqs(self) -> int:
        """The largest decode batch captured as a CUDA graph."""
        return min(self.max_cuda_graph_size or self.max_num_seqs, self.max_num_seqs)

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept in host memory at most."""
        return self.max_cpu_loras or self.max_loras

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

"""BenchOptions: everything one `batchgen bench` run depends on, with its defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.bench.gemm_rate import DECODE_NUM_TOKENS, PREFILL_NUM_TOKENS
from batchgen.bench.peer import DEFAULT_BATCH_SIZES
from batchgen.bench.workloads import WORKLOADS

DEFAULT_MODEL = "smollm2-135m-instruct"
BENCH_QUANTIZATIONS = ("int8", "int4")  # weights quantized at load from the same float checkpoint
DEFAULT_NUM_REQUESTS = 64  # random and shared-prefix; chat takes the whole prompt set
# hf: HF transformers generate in this process (bench/peer.py); vllm: vLLM's CPU build in its own
# environment (bench/peers/vllm_cpu.py); none: the engine alone.
PEERS = ("hf", "vllm", "none")
BENCH_DTYPES = ("float32", "bfloat16", "auto")  # the engine's model.dtype; the peer runs the one it resolves to


@dataclass
class BenchOptions:
    """Everything a bench run depends on; the CLI fills it, tests build it directly."""

    workload: str = "random"
    model: str = DEFAULT_MODEL
    num_requests: int | None = None  # None: 64 (random, shared-prefix) or the whole set (chat)
    input_len_min: int = 100
    input_len_max: int = 200
    output_len: int = 64
    seed: int = 0
    peer: str | None = None  # hf | vllm | none; None: hf, except none for shared-prefix
    dtype: str = "float32"  # the engine's model.dtype (auto: what it picks on this CPU); the peer runs the same
    vllm_reps: int = 2  # vllm: timed repetitions (its fastest is reported)
    peer_batch_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_BATCH_SIZES))
    engine_overrides: dict = field(default_factory=dict)
    num_threads: int | None = None  # None: torch's default
    prompts: str | None = None  # chat prompt set; None: jobs/data/chat_prompts.parquet
    prefill_gemm_tokens: int = PREFILL_NUM_TOKENS
    decode_gemm_tokens: int = DECODE_NUM_TOKENS
    gemm_min_seconds: float = 0.3
    is_warmup: bool = True
    is_quality: bool = False  # run the quality bench (FP8, and `quantizations`) instead of the throughput comparison
    # int8 / int4: also run the engine with those weights (quantized at load) over the same workload,
    # in the same process, beside the float32 engine; with --quality, also compare their logits.
    quantizations: list[str] = field(default_factory=list)
    kv_cache_dtype: str | None = None  # with is_quality: FP8 KV against the float32 cache; else an engine setting
    # copy workload (speculative decoding): drafts per verify, the draft model (None: the model itself)
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    draft_quantization: str | None = None
    copy_batches: tuple[int, ...] = (1, 8, 64)  # running batches of the copy workload
    # a JSON schema file: the workload constrained by it on every request against none (structured_bench.py)
    structured_schema: str | None = None
    structured_runs: int = 3  # interleaved (unconstrained, constrained) pairs

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {self.workload!r}")
        if self.peer is not None and self.peer not in PEERS:
            raise ValueError(f"--peer must be one of {', '.join(PEERS)}; got {self.peer!r}")
        if self.dtype not in BENCH_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(BENCH_DTYPES)}; got {self.dtype!r}")
        if self.peer_kind == "vllm" and self.workload not in ("random", "chat", "shared-prefix", "moe"):
            raise ValueError(f"--peer vllm runs the random, chat, shared-prefix and moe workloads, not {self.workload}")
        if self.vllm_reps < 1:
            raise ValueError(f"vllm_reps must be >= 1; got {self.vllm_reps}")
        if self.structured_schema is not None and self.workload not in ("random", "chat", "shared-prefix"):
            raise ValueError(f"--structured-schema runs the random, chat or shared-prefix workload; got {self.workload}")
        if self.structured_schema is not None:
            from batchgen.bench.structured_bench import read_schema

            read_schema(self.structured_schema)  # a missing or unreadable file fails before any loading
        if self.structured_runs < 1:
            raise ValueError(f"--structured-runs must be >= 1; got {self.structured_runs}")
        unknown = [q for q in self.quantizations if q not in BENCH_QUANTIZATIONS]
        if unknown:
            raise ValueError(f"--quantization takes {', '.join(BENCH_QUANTIZATIONS)}; got {', '.join(unknown)}")

    @property
    def peer_kind(self) -> str:
        """hf | vllm | none, the default resolved."""
        if self.peer is not None:
            return self.peer
        return "none" if self.workload == "shared-prefix" or self.structured_schema is not None else "hf"

    @property
    def is_peer(self) -> bool:
        return self.peer_kind != "none"

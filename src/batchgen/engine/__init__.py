"""batchgen.engine: the generation engine (no Parquet, no YAML in here)."""

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.core.outputs import (
    CompletionOutput,
    ContinuationScore,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    ScoreOutput,
    TopLogprob,
)
from batchgen.engine.decoding.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from batchgen.engine.llm import LLM
from batchgen.engine.lora.request import LoRARequest
from batchgen.engine.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
)
from batchgen.engine.sampling.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "ContinuationScore",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoreOutput",
    "TopLogprob",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "LoRARequest",
]

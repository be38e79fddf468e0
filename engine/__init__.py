"""batchgen.engine: the generation engine (no Parquet, no YAML in here)."""

from batchgen.engine.config import EngineConfig
from batchgen.engine.llm import LLM
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TopLogprob
from batchgen.engine.sampling_params import SamplingParams

__all__ = [
           "LLM",
           "CompletionOutput",
           "EngineConfig",
           "LLMEngine",
           "RequestMetrics",
           "RequestOutput",
           "SamplingParams",
           "TopLogprob",
]

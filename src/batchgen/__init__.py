"""batchgen: offline batch generation for LLMs; Parquet prompts in, Parquet completions out.

The public Python face, with vLLM's names:

    from batchgen import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

`LLM` and `SamplingParams` load on first use, so `import batchgen` itself (the version, a subpackage
that needs no engine) does not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__", "LoRARequest"]

if TYPE_CHECKING:
    from batchgen.engine.llm import LLM
    from batchgen.engine.lora.request import LoRARequest
    from batchgen.engine.sampling.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from batchgen.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from batchgen.engine.sampling.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from batchgen.engine.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")

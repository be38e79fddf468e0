"""LLM: the offline convenience API (vLLM's names)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from batchgen.engine.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine, PromptInput
from batchgen.engine.outputs import RequestOutput
from batchgen.engine.sampling_params import SamplingParams


class LLM:
    """`LLM("smollm2-135m-instruct", dtype="float32", device="cpu")`.

    Keywords are EngineConfig's fields (the job file's `model` and `engine` keys, plus the
    engine-only ones); EngineConfig checks them. `speculative_config=` is vLLM's name for `speculative=`.
    """

    def __init__(self, model: str, **settings):
        settings = _speculative_alias(settings)
        _check_names(settings)
        self.engine = LLMEngine(EngineConfig(model=model, **settings))
        self._next_id = 0

    def with_engine_settings(self, **changes) -> LLM:
        """A new LLM over this one's loaded weights and tokenizer with other KV/scheduling settings
        (llm_engine.RUNTIME_SETTINGS; max_model_len may only shrink): its own KV pool, scheduler and
        counters."""
        changes = _speculative_alias(changes)
        _check_names(changes)
        other = object.__new__(LLM)
        other.engine = LLMEngine(self.engine.config.replace(**changes), weights_from=self.engine)
        other._next_id = 0
        return other

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Seq[PromptInput],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} SamplingParams")
        ids = []
        for prompt, params in zip(prompts, sampling_params):
            request_id = str(self._next_id)
            self._next_id += 1
            # A seeded request's samples depend on (seed, sample index) alone, as the server's do:
            # the same prompt and seed give the same samples in any call. Unseeded ones are keyed by
            # this LLM's request counter (reproducible from a fresh LLM).
            self.engine.add_request(request_id, prompt, params, sample_key="" if params.seed is not None else None)
            ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="requests") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        return [results[i] for i in ids]


def _speculative_alias(settings: dict) -> dict:
    if "speculative_config" not in settings:
        return settings
    if "speculative" in settings:
        raise TypeError("give speculative or its alias speculative_config, not both")
    settings = dict(settings)
    settings["speculative"] = settings.pop("speculative_config")
    return settings


def _check_names(settings: dict) -> None:
    # A misspelt keyword would otherwise be a bare "unexpected keyword argument" from the dataclass.
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise TypeError(f"unknown engine setting(s) {', '.join(unknown)}; "
                        f"EngineConfig's are: {', '.join(names)}")

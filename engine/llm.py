"""LLM: the offline convenience API (vLLM's names)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from batchgen.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from batchgen.engine.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine, PromptInput
from batchgen.engine.outputs import RequestOutput, ScoreOutput
from batchgen.engine.sampling_params import SamplingParams
from batchgen.engine.score_group import encode_continuations


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
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptInput | dict | Seq[PromptInput | dict], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best beams of each prompt, best first (HF's
        algorithm and ranking, beam_search.py). A prompt is as in `generate`, or vLLM's
        {"prompt": text} / {"prompt_token_ids": ids}."""
        if isinstance(prompts, (str, dict)) or _is_messages(prompts):
            prompts = [prompts]
        prompts = [_from_prompt_dict(p) for p in prompts]
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm)
        return [BeamSearchOutput([BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.logprobs,
                                                     c.cumulative_logprob, c.text, c.finish_reason, c.stop_reason,
                                                     c.score) for c in out.outputs])
                for out in outputs]

    def score_continuations(self, contexts: str | Seq[str], continuations: Seq[str] | Seq[Seq[str]],
                            use_tqdm: bool = False) -> list[ScoreOutput]:
        """The log-probability of each continuation given its context (lm-evaluation-harness'
        loglikelihood: `sum_logprob`, `is_greedy`), each context computed once for all its continuations
        (score_group.py). Raw text: contexts and continuations are tokenized as lm-evaluation-harness
        does (context + continuation as one text, split after the context's tokens)."""
        if isinstance(contexts, str):
            contexts, continuations = [contexts], [continuations]
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuation lists")
        ids = []
        encode = self.engine.tokenizer.encode
        for context, conts in zip(contexts, continuations):
            request_id = str(self._next_id)
            self._next_id += 1
            context_ids, cont_ids = encode_continuations(encode, context, list(conts))
            self.engine.add_score_request(request_id, context_ids, cont_ids)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        results = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="requests") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        return [results[i] for i in ids]


def _is_messages(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def _from_prompt_dict(prompt):
    """vLLM's TextPrompt / TokensPrompt dicts as the text or the token ids they hold."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a prompt dict holds 'prompt' (text) or 'prompt_token_ids'")
    return prompt


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

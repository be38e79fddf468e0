"""LLM: the offline convenience API (vLLM's names)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.core.outputs import RequestOutput, RequestOutputKind, ScoreOutput
from batchgen.engine.decoding.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from batchgen.engine.decoding.score_group import encode_continuations
from batchgen.engine.lora.request import LoRARequest
from batchgen.engine.pooling.llm_methods import PoolingMethods
from batchgen.engine.sampling.sampling_params import SamplingParams
from batchgen.engine.text.chat_template import ChatTemplateOptions
from batchgen.engine.text.tool_parsers import get_tool_parser
from batchgen.engine.text.tools import (
    check_tool_choice,
    check_tools,
    forced_constraint,
    parse_tool_output,
    template_messages,
)

# vLLM's prompt dicts: TextPrompt {"prompt": str} and TokensPrompt {"prompt_token_ids": [int, ...]}
# (which may carry the text as "prompt" too). Their other keys are multimodal inputs.
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}
_UNSUPPORTED_PROMPT_KEYS = {"multi_modal_data": "multimodal inputs are not implemented",
                            "mm_processor_kwargs": "multimodal inputs are not implemented",
                            "token_type_ids": "token type ids are for encoder models",
                            "cache_salt": "prefix-cache salts are not implemented"}
PROMPT_FORMS = ("a prompt is a string, {'prompt': str}, {'prompt_token_ids': [int, ...]}, a list of token "
                "ids, or a conversation (a list of {'role', 'content'} messages; LLM.chat takes those with "
                "chat-template settings)")


@dataclasses.dataclass(frozen=True)
class _Prompt:
    """One request's prompt as the engine takes it: text or messages, or token ids (with their text)."""

    prompt: str | list[dict] | None
    token_ids: list[int] | None = None


class LLM(PoolingMethods):
    """`LLM("smollm2-135m-instruct", dtype="float32", device="cpu")`.

    A sequence classifier (`*ForSequenceClassification`, e.g. a reward model) loads as a pooling model
    (`runner="pooling"`, or auto): `classify`, `reward` and `encode` (engine/pooling/llm_methods.py).

    Keywords are EngineConfig's fields (the job file's `model` and `engine` keys, plus the
    engine-only ones); EngineConfig checks them. `speculative_config=` is vLLM's name for `speculative=`.
    A Hugging Face repo id (`"HuggingFaceTB/SmolLM2-135M-Instruct"`, `revision=`) is found in the local
    HF cache, or downloaded where the Hub is reachable (engine/loader/source.py).
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
        """batchgen's Tokenizer (encode / decode / render_chat); `get_tokenizer()` is the transformers one."""
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The transformers tokenizer, as vLLM's `LLM.get_tokenizer()` returns it (apply_chat_template, ...)."""
        return self.engine.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (`generation_config: auto`,
        vLLM's rule): what `generate` and `chat` use when given no sampling_params."""
        return SamplingParams(**self.engine.generation_defaults.values)

    def generate(self, prompts: Any, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list of them; outputs come back in input order.

        A prompt is a string, vLLM's `{"prompt": str}` (TextPrompt) or `{"prompt_token_ids": [...]}`
        (TokensPrompt), a list of token ids, or a chat conversation (a list of messages, rendered with
        the model's chat template; `chat` takes template settings). Anything else is a TypeError.
        `sampling_params=None`: `get_default_sampling_params()`. `lora_request` (vLLM's): the LoRA adapter
        of every prompt, or a list with one (or None: the base model) per prompt; needs enable_lora.
        """
        return self._generate([self._prompt(p) for p in _prompt_list(prompts)], sampling_params, use_tqdm,
                              lora_request)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = False,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """vLLM's offline chat: one conversation (a list of {role, content} messages) or a list of them,
        rendered with the model's chat template (or `chat_template`, its text), then generated like
        `generate` (the same batching and seeding); outputs come back in input order.

        `add_generation_prompt` ends the prompt with the assistant's turn header;
        `continue_final_message` (with add_generation_prompt=False) continues the last, assistant
        message instead; `chat_template_kwargs` are extra template variables (e.g. enable_thinking).
        `chat_template_content_format` is accepted for vLLM's signature only: message content goes
        to the template as given (a string, for the templates this engine's models ship).

        `tools` (OpenAI's tool definitions) go to the template; `tool_choice` is OpenAI's (none, auto,
        required, {"type": "function", "function": {"name": ...}}; default auto with the engine's
        tool_call_parser, else the tools are only shown): required and a named function are forced
        (engine/text/tools.py), and each sample's calls are read into `CompletionOutput.tool_calls`
        (its `content` then holds the text outside them, finish_reason `tool_calls`).

        `lora_request`: as in `generate`.
        """
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be auto, string or openai; "
                             f"got {chat_template_content_format!r}")
        options = ChatTemplateOptions(chat_template, add_generation_prompt, continue_final_message,
                                      chat_template_kwargs or {})
        if chat_template is not None:
            self.engine.tokenizer.check_chat_template(options)
        conversations = messages if messages and all(isinstance(m, list) for m in messages) else [messages]
        for i, conversation in enumerate(conversations):
            if not _is_conversation(conversation):
                raise TypeError(f"messages[{i}] is not a conversation: LLM.chat takes a list of "
                                "{'role', 'content'} messages or a list of such lists")
        tool_request = check_tool_choice(tool_choice, check_tools(tools) if tools is not None else None)
        parser = None
        if tool_request is not None:
            options, sampling_params, parser = self._with_tools(tool_request, tool_choice, options, sampling_params)
        prompts = [_Prompt(None, self.engine.encode(template_messages(c), chat=options)) for c in conversations]
        outputs = self._generate(prompts, sampling_params, use_tqdm, lora_request)
        if parser is not None:
            for completion in (c for out in outputs for c in out.outputs):
                text = completion.content if completion.content is not None else completion.text
                completion.content, completion.tool_calls, completion.finish_reason = parse_tool_output(
                    parser, text, completion.finish_reason)
        return outputs

    def _with_tools(self, request, tool_choice, options, sampling_params):
        """(chat options with the tools, sampling params forcing the calls where asked, the parser that
        reads them or None)."""
        parser_name = self.engine.config.tool_call_parser
        if request.choice == "auto" and parser_name is None:
            if tool_choice is not None:
                raise ValueError("tool_choice auto needs a tool call parser: LLM(..., tool_call_parser=NAME)")
            request = dataclasses.replace(request, choice="none")  # the tools are shown, calls not read
        parser = get_tool_parser(parser_name or "hermes")
        constraint = forced_constraint(parser, request)
        if constraint is not None or (request.is_parsed and parser.keeps_special_tokens):
            if sampling_params is None:
                sampling_params = self.get_default_sampling_params()
            many = not isinstance(sampling_params, SamplingParams)
            changed = []
            for params in (sampling_params if many else [sampling_params]):
                if constraint is not None and params.structured_outputs is not None:
                    raise ValueError("tool_choice forces tool calls; the sampling params carry structured_outputs too")
                changes = {"structured_outputs": constraint} if constraint is not None else {}
                if request.is_parsed and parser.keeps_special_tokens:
                    changes["skip_special_tokens"] = False  # the format's marker is a control token
                changed.append(dataclasses.replace(params, **changes))
            sampling_params = changed if many else changed[0]
        return dataclasses.replace(options, tools=request.tools), sampling_params, \
            (parser if request.is_parsed else None)

    # ---- shared by generate and chat --------------------------------------------------------------
    def _prompt(self, prompt: Any) -> _Prompt:
        if isinstance(prompt, dict):
            token_ids = prompt.get("prompt_token_ids")
            if token_ids is None:
                return _Prompt(prompt["prompt"])
            return _Prompt(prompt.get("prompt"), self._checked_ids(list(token_ids)))
        if _is_token_ids(prompt):
            return _Prompt(None, self._checked_ids(list(prompt)))
        return _Prompt(prompt)

    def _checked_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = self.engine.model_cfg.vocab_size
        if any(t < 0 or t >= vocab_size for t in token_ids):
            raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab_size})")
        return token_ids

    def _generate(self, prompts: list[_Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None,
                  use_tqdm: bool, lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
                  ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} SamplingParams")
        lora_requests = _lora_list(lora_request, len(prompts), "prompts")
        seed = self.engine.config.seed

        def add(request_id: str, item: tuple[_Prompt, SamplingParams, LoRARequest | None]) -> None:
            prompt, params, lora = item
            if params.output_kind is not RequestOutputKind.FINAL_ONLY:  # as vLLM's LLM: one output per request
                params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            # A seeded request's samples depend on (seed, sample index) alone, as the server's do:
            # the same prompt and seed give the same samples in any call. Unseeded ones are keyed by
            # this LLM's request counter (reproducible from a fresh LLM), and by the engine's seed if set.
            if params.seed is not None:
                sample_key = ""
            else:
                sample_key = None if seed is None else f"engine-seed-{seed}/{request_id}"
            self.engine.add_request(request_id, prompt.prompt, params, prompt_token_ids=prompt.token_ids,
                                    sample_key=sample_key, lora_request=lora)
        return self._collect(self._add_all(zip(prompts, sampling_params, lora_requests), add), use_tqdm)

    def beam_search(self, prompts: Any, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best beams of each prompt, best first (HF's
        algorithm and ranking, beam_search.py). Prompts are as in `generate` (vLLM's {"prompt": text} /
        {"prompt_token_ids": ids} included)."""
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm)
        return [BeamSearchOutput([BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.logprobs,
                                                     c.cumulative_logprob, c.text, c.finish_reason, c.stop_reason,
                                                     c.score) for c in out.outputs])
                for out in outputs]

    def score_continuations(self, contexts: str | Seq[str], continuations: Seq[str] | Seq[Seq[str]],
                            use_tqdm: bool = False,
                            lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[ScoreOutput]:
        """The log-probability of each continuation given its context (lm-evaluation-harness'
        loglikelihood: `sum_logprob`, `is_greedy`), each context computed once for all its continuations
        (score_group.py). Raw text: contexts and continuations are tokenized as lm-evaluation-harness
        does (context + continuation as one text, split after the context's tokens). `lora_request`: the
        adapter of every context, or one (or None) per context, as in `generate`."""
        if isinstance(contexts, str):
            contexts, continuations = [contexts], [continuations]
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuation lists")
        lora_requests = _lora_list(lora_request, len(contexts), "contexts")
        encode = self.engine.tokenizer.encode

        def add(request_id: str, item: tuple[str, Seq[str], LoRARequest | None]) -> None:
            context_ids, cont_ids = encode_continuations(encode, item[0], list(item[1]))
            self.engine.add_score_request(request_id, context_ids, cont_ids, lora_request=item[2])
        return self._collect(self._add_all(zip(contexts, continuations, lora_requests), add), use_tqdm)

    def _parsed_prompts(self, prompts: Any) -> list[_Prompt]:
        """One prompt or a list of them, each as text / messages or token ids (TypeError otherwise)."""
        return [self._prompt(p) for p in _prompt_list(prompts)]

    def _add_all(self, items, add) -> list[str]:
        """`add(request_id, item)` for each item; the ids in order. When one cannot be added, those
        already queued are aborted before the error is raised: nothing of a failed call stays queued."""
        ids = []
        try:
            for item in items:
                request_id = self._new_request_id()
                add(request_id, item)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return ids

    def _new_request_id(self) -> str:
        request_id = str(self._next_id)
        self._next_id += 1
        return request_id

    def _collect(self, ids: list[str], use_tqdm: bool) -> list:
        """Step the engine until it is idle; the outputs of `ids` in their order."""
        results = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="requests") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        return [results[i] for i in ids]


def _prompt_list(prompts: Any) -> list:
    """`prompts` as a list of single prompts; TypeError naming the accepted forms for anything else."""
    if _is_single_prompt(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and all(_is_single_prompt(p) for p in prompts):
        return list(prompts)
    # A prompt dict with a key too many: name the key.
    if isinstance(prompts, dict) and "role" not in prompts:
        _check_prompt_dict(prompts)
    elif isinstance(prompts, (list, tuple)):
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, dict) and prompt.keys() & _PROMPT_KEYS:
                _check_prompt_dict(prompt, f"prompts[{i}]")
    raise TypeError(f"cannot read prompts of type {_describe(prompts)}: {PROMPT_FORMS}; prompts is one "
                    "prompt or a list of them")


def _is_single_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, dict):
        return _is_prompt_dict(value)
    return _is_token_ids(value) or _is_conversation(value)


def _is_prompt_dict(value: dict) -> bool:
    if not value.keys() & _PROMPT_KEYS or value.keys() - _PROMPT_KEYS:
        return False
    if "prompt_token_ids" in value:
        return _is_token_ids(value["prompt_token_ids"]) and isinstance(value.get("prompt", ""), str)
    return isinstance(value["prompt"], str)


def _check_prompt_dict(value: dict, where: str = "the prompt") -> None:
    unsupported = sorted(value.keys() & _UNSUPPORTED_PROMPT_KEYS)
    if unsupported:
        raise ValueError(f"{where}: {unsupported[0]} is not supported ({_UNSUPPORTED_PROMPT_KEYS[unsupported[0]]})")
    unknown = sorted(value.keys() - _PROMPT_KEYS)
    if unknown:
        raise TypeError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; {PROMPT_FORMS}")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "role" in m and not m.keys() & _PROMPT_KEYS for m in value)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)) and value:
        inner = sorted({type(v).__name__ for v in value})
        return f"{type(value).__name__} of {' / '.join(inner)}"
    return type(value).__name__


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


def _lora_list(lora_request: LoRARequest | Seq[LoRARequest | None] | None, count: int,
               what: str) -> list[LoRARequest | None]:
    """One LoRARequest (or None) per prompt: the one given for all, or the list checked."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    requests = list(lora_request)
    if len(requests) != count:
        raise ValueError(f"{count} {what} but {len(requests)} LoRA requests")
    for i, request in enumerate(requests):
        if request is not None and not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request[{i}] is a {type(request).__name__}, not a LoRARequest or None")
    return requests

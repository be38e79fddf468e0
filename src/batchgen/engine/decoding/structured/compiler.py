"""GrammarCompiler: StructuredOutputsParams -> a compiled grammar for one tokenizer, cached by spec hash.

One compiler per engine (per tokenizer and vocabulary). A compile turns the constraint into an
llguidance grammar and builds a matcher for it over the tokenizer (about 2 ms for a 30-field schema
on this CPU, 1 ms for a regex or a choice list; the tokenizer's view of the vocabulary is built at
the first compile, 0.4-1.4 s here). That matcher, at the grammar's start, is the compiled grammar:
each request's GrammarState starts from a copy of it (~15 us). Compiled grammars are kept in a
bounded LRU keyed by `StructuredOutputsParams.key` (a hash of the canonical spec and its options), so
a job whose rows share a handful of schemas compiles each once; a constraint that fails to compile
is remembered as well, so a bad schema repeated on many rows fails fast each time.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from batchgen.engine.decoding.structured.bitmask import bitmask_to_allowed, num_bitmask_words
from batchgen.engine.decoding.structured.grammar_state import GrammarState, fill_row
from batchgen.engine.decoding.structured.library import library_message, load_library
from batchgen.engine.decoding.structured.limits import MAX_ITEMS_IN_ROW, check_constraint_limits
from batchgen.engine.decoding.structured.params import StructuredOutputError, StructuredOutputsParams
from batchgen.engine.decoding.structured.strict_schema import close_objects

DEFAULT_MAX_CACHED = 512
DEFAULT_COMPILE_TIMEOUT_S = 10.0  # a 10,000-property schema took 15 s here: past this, refused
COMPILE_STACK_BYTES = 256 << 20
_STACK_SIZE_LOCK = threading.Lock()
# JSON options for `disable_any_whitespace`: no free whitespace, and the separators json.dumps writes.
_FIXED_WHITESPACE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for one vocabulary. `matcher` (the library's, at the grammar's start) is
    never advanced: states copy it. `stop_token_ids` end the output once the grammar is complete."""

    key: str
    kind: str
    matcher: object
    vocab_size: int
    stop_token_ids: frozenset[int]
    compile_seconds: float


@dataclass
class CompilerStats:
    num_compiles: int = 0  # compiles run (failed ones included)
    num_cache_hits: int = 0
    compile_seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"num_compiles": self.num_compiles, "num_cache_hits": self.num_cache_hits,
                "compile_seconds": self.compile_seconds}


def compile_off_thread(build: Callable[[], object], field_name: str, timeout_s: float):
    """`build()` on a thread of its own with a COMPILE_STACK_BYTES stack, waited on for `timeout_s`.

    The library recurses natively over a grammar's structure; the calling thread's stack (8 MB on the
    main thread, less on others) bounds how deep that may go, and an overflow is a crash, not an error.
    The large stack (address space: pages are touched only as used) puts that far past the depth limits
    (limits.py) let through. The library releases the GIL while it compiles, so the wait ends on time:
    a compile past the deadline is a StructuredOutputError for this request, and its thread (a daemon)
    finishes, unwaited, in the background."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = build()
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    with _STACK_SIZE_LOCK:  # threading.stack_size is process-wide: set it only for this thread's start
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join(timeout_s)
    if thread.is_alive():
        raise StructuredOutputError(field_name, f"took longer than {timeout_s:g} s to compile; simplify it "
                                                "(fewer alternatives or optional properties)")
    if "error" in result:
        raise result["error"]
    return result["value"]


class GrammarCompiler:
    """Compiles constraints against `hf_tokenizer` (a transformers fast tokenizer) over `vocab_size`
    token ids (the model's logits width; ids past the tokenizer's are never allowed). Once a grammar is
    complete only `stop_token_ids` (the engine's EOS set) are allowed: a constrained output finishes
    with `stop` there. `max_cached`: compiled grammars kept (least recently used dropped first);
    `compile_timeout_s`: how long one compile may take before its constraint is refused."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *,
                 max_cached: int = DEFAULT_MAX_CACHED, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        if max_cached < 1:
            raise ValueError(f"max_cached must be >= 1; got {max_cached}")
        if not stop_token_ids:
            raise ValueError("a grammar needs at least one stop token id to end on")
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_cached = max_cached
        self.compile_timeout_s = compile_timeout_s
        self.stats = CompilerStats()
        self._cache: OrderedDict[str, CompiledGrammar | StructuredOutputError] = OrderedDict()
        self._lock = threading.Lock()
        self._llg = None
        self._tokenizer = None  # the library's view of the vocabulary, made at the first compile

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _library_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                llg = load_library()
                self._tokenizer = llg.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                        eos_token=sorted(self.stop_token_ids))
                self._llg = llg
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params` (cached). StructuredOutputError naming the field when the
        library cannot compile it or it matches no output at all."""
        key = params.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
        if isinstance(hit, StructuredOutputError):
            raise StructuredOutputError(hit.field, hit.reason)
        if hit is not None:
            return hit
        tokenizer = self._library_tokenizer()
        start = time.perf_counter()
        result: CompiledGrammar | StructuredOutputError
        try:
            check_constraint_limits(params)  # before the library sees it: its recursion can crash the process
            matcher = compile_off_thread(lambda: self._build_matcher(tokenizer, params), params.kind,
                                         self.compile_timeout_s)
            self._check_matches_output(matcher, params.kind)
            result = CompiledGrammar(key, params.kind, matcher, self.vocab_size, self.stop_token_ids,
                                     time.perf_counter() - start)
        except StructuredOutputError as exc:
            result = exc
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.num_compiles += 1
            self.stats.compile_seconds += seconds
            self._cache[key] = result
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        if isinstance(result, StructuredOutputError):
            raise result
        return result

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh GrammarState for one request (its compiled grammar from the cache when there)."""
        return GrammarState(self.compile(params))

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        llg = self._llg
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = close_objects(params.json) if kind == "json" else {"type": "object"}
            options = _FIXED_WHITESPACE if params.disable_any_whitespace else {"whitespace_flexible": True}
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llg.LLMatcher.grammar_from_lark(choice_grammar(params.choice))
        return llg.grammar_from("gbnf" if "::=" in params.grammar else "lark", params.grammar)

    def _build_matcher(self, tokenizer, params: StructuredOutputsParams):
        kind = params.kind
        try:
            grammar = self._grammar_text(params)
            # log_level 0: the library reports through get_error(), which becomes the error raised here.
            matcher = self._llg.LLMatcher(tokenizer, grammar, log_level=0, limits=self._parser_limits())
        except (ValueError, TypeError, RuntimeError) as exc:  # a grammar the converters refuse
            raise StructuredOutputError(kind, f"cannot compile: {library_message(str(exc))}") from None
        if matcher.is_error():
            raise StructuredOutputError(kind, f"cannot compile: {library_message(matcher.get_error())}")
        return matcher

    def _parser_limits(self):
        """The library's per-step bounds. Its default of 2,000 Earley items in a row fails, at the first
        token, any choice of over ~2,000 strings or a schema of ~500 optional properties; 20,000 admits
        what limits.py lets through (MAX_CHOICES), and a row that large costs one mask fill ~30-50 ms
        (measured on the bundled tokenizer). Terse errors: a verbose one quotes the whole grammar."""
        return self._llg.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)

    def _check_matches_output(self, matcher, field_name: str) -> None:
        """A grammar that allows nothing but a stop token at its start and is not complete there matches
        no output (an empty character class, a rule that never ends): refused here, where the library
        would let such a request end at once with an empty output."""
        if matcher.is_accepting():
            return  # the empty output matches: a stop token first is a real answer
        mask = torch.zeros((1, num_bitmask_words(self.vocab_size)), dtype=torch.int32)
        fill_row(matcher, mask, 0)
        allowed = bitmask_to_allowed(mask, self.vocab_size)[0]  # (V,)
        allowed[sorted(self.stop_token_ids)] = False
        if not bool(allowed.any()):
            raise StructuredOutputError(field_name, "matches no output this tokenizer can produce")


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar whose language is exactly `choices`: JSON string escapes (\\", \\\\, \\n, \\uXXXX)
    are Lark's string escapes too, so any text is quoted exactly."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)

"""GrammarCompiler: StructuredOutputsParams -> a compiled grammar for one tokenizer, cached by spec hash.

One compiler per engine (per tokenizer and vocabulary). A compile turns the constraint into
xgrammar's grammar and precomputes its per-state token masks over the vocabulary: milliseconds for
a regex or a choice list, tens of milliseconds for a 30-field schema (benchmarks/NOTES.md), and the
tokenizer's vocabulary view (~0.3 s) is built at the first compile. Compiled grammars are kept in a
bounded LRU keyed by `StructuredOutputsParams.key` (a hash of the canonical spec and its options), so
a job whose rows share a handful of schemas compiles each once; a constraint that fails to compile
is remembered as well, so a bad schema repeated on many rows fails fast each time.

A compiled grammar is read-only and shared: each request walks it with its own GrammarState.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from batchgen.engine.structured.grammar_state import GrammarState
from batchgen.engine.structured.library import load_library
from batchgen.engine.structured.params import StructuredOutputError, StructuredOutputsParams

DEFAULT_MAX_CACHED = 512
# xgrammar prefixes its errors with a timestamp and the C++ source line ("[07:56:10] /project/cpp/
# json_schema_converter.cc:5082: ") and sometimes a failed check's text: the user needs neither.
_LIBRARY_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for one vocabulary; `handle` is the library's compiled grammar."""

    key: str
    kind: str
    handle: object
    vocab_size: int
    compile_seconds: float


@dataclass
class CompilerStats:
    num_compiles: int = 0  # compiles run (failed ones included)
    num_cache_hits: int = 0
    compile_seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"num_compiles": self.num_compiles, "num_cache_hits": self.num_cache_hits,
                "compile_seconds": self.compile_seconds}


def _default_num_threads() -> int:
    """Half the cores, at most 8 (vLLM's figure): compiles share the machine with the model."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def library_message(exc: Exception) -> str:
    """The library's error text without its timestamp and source-line prefix, on one line."""
    text = _LIBRARY_PREFIX.sub("", str(exc)).strip()
    return " ".join(text.split()) or type(exc).__name__


class GrammarCompiler:
    """Compiles constraints against `hf_tokenizer` (a transformers tokenizer) over `vocab_size` token ids
    (the model's logits width; ids past the tokenizer's are never allowed). A grammar's end allows only
    `stop_token_ids` (the engine's EOS set): a constrained output finishes with `stop` there.

    `max_cached`: compiled grammars kept (least recently used dropped first); `num_threads`: the
    library's threads per compile."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *,
                 max_cached: int = DEFAULT_MAX_CACHED, num_threads: int | None = None):
        if max_cached < 1:
            raise ValueError(f"max_cached must be >= 1; got {max_cached}")
        if not stop_token_ids:
            raise ValueError("a grammar needs at least one stop token id to end on")
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_cached = max_cached
        self.num_threads = num_threads or _default_num_threads()
        self.stats = CompilerStats()
        self._cache: OrderedDict[str, CompiledGrammar | StructuredOutputError] = OrderedDict()
        self._lock = threading.Lock()
        self._library = None
        self._compiler = None  # the library's compiler, made with the tokenizer info at the first compile

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _library_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = load_library()
                info = xgr.TokenizerInfo.from_huggingface(self.hf_tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.stop_token_ids))
                # Its own cache off: this class's LRU is the one cache (bounded, and it remembers failures).
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.num_threads, cache_enabled=False)
                self._library = xgr
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params` (cached). StructuredOutputError naming the field when the
        library cannot compile it or it allows no output at all."""
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
        compiler = self._library_compiler()
        start = time.perf_counter()
        result: CompiledGrammar | StructuredOutputError
        try:
            handle = self._compile(compiler, params)
            self._check_allows_output(handle, params.kind)
            result = CompiledGrammar(key, params.kind, handle, self.vocab_size, time.perf_counter() - start)
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

    def _compile(self, compiler, params: StructuredOutputsParams):
        kind = params.kind
        any_whitespace = not params.disable_any_whitespace
        try:
            if kind == "json":
                return compiler.compile_json_schema(params.spec, any_whitespace=any_whitespace, strict_mode=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                    strict_mode=True)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            if "::=" in params.grammar:
                return compiler.compile_grammar(params.grammar)
            return compiler.compile_lark(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:  # the library's compile errors
            what = {"json": "cannot compile this JSON schema", "regex": "cannot compile this regex",
                    "choice": "cannot compile the choice list", "grammar": "cannot compile this grammar",
                    "json_object": "cannot compile the JSON object grammar"}[kind]
            raise StructuredOutputError(kind, f"{what}: {library_message(exc)}") from None

    def _check_allows_output(self, handle, field_name: str) -> None:
        """A grammar whose first mask allows no token matches no output (an empty regex class, a rule
        that can never end): refused here rather than stalling a request at its first token."""
        import torch

        xgr = self._library
        mask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        xgr.GrammarMatcher(handle).fill_next_token_bitmask(mask, 0)
        if not bool(mask.any()):
            raise StructuredOutputError(field_name, "matches no output this tokenizer can produce")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`. JSON string escapes (\\", \\\\, \\n, \\uXXXX)
    are the grammar's string escapes too, so any text is quoted exactly."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

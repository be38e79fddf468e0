"""StructuredOutputManager: the engine's side of structured output (compile at add_request, counters).

One per engine. Its GrammarCompiler is made at the first constraint (so an engine that never sees one
never imports the grammar library), over the engine's tokenizer, its logits width and its EOS set: a
constrained output ends with EOS where its grammar is complete, so it finishes with `stop` there.
Engines that share loaded weights (`LLMEngine(weights_from=...)`) share the compiler and its cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from batchgen.engine.decoding.structured.compiler import CompiledGrammar, GrammarCompiler
from batchgen.engine.decoding.structured.grammar_state import GrammarState
from batchgen.engine.decoding.structured.params import StructuredOutputError, StructuredOutputsParams
from batchgen.engine.decoding.structured.step_bitmask import MaskStats


class StructuredOutputManager:
    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *,
                 shared: StructuredOutputManager | None = None):
        """`hf_tokenizer`: the engine's transformers tokenizer (None: a model without one, which cannot
        take a constraint); `shared`: an engine's manager whose compiler this one uses."""
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._shared = shared
        self._compiler: GrammarCompiler | None = None
        self.num_constrained_requests = 0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._shared is not None:
            return self._shared.compiler
        if self._compiler is None:
            if self.hf_tokenizer is None:
                raise StructuredOutputError(None, "needs the model's tokenizer; this engine has none")
            self._compiler = GrammarCompiler(self.hf_tokenizer, self.vocab_size, self.stop_token_ids)
        return self._compiler

    def compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar (from the cache when compiled before); StructuredOutputError naming the
        field when it cannot be used, StructuredOutputUnavailable when the library is not installed."""
        return self.compiler.compile(constraint)

    def new_states(self, constraint: StructuredOutputsParams, num_samples: int) -> list[GrammarState]:
        """One fresh state per sample of a new request (compiled first: errors before anything is queued)."""
        grammar = self.compile(constraint)
        self.num_constrained_requests += 1
        return [GrammarState(grammar) for _ in range(num_samples)]

    def stats(self, mask: MaskStats) -> dict:
        """Constrained requests, the compiler's counters (shared ones: over the engines that share it),
        and the runner's mask counters."""
        compiler = None
        if self._shared is not None or self._compiler is not None:
            compiler = self.compiler
        compiles = compiler.stats.as_dict() if compiler is not None else \
            {"num_compiles": 0, "num_cache_hits": 0, "compile_seconds": 0.0}
        return {"num_constrained_requests": self.num_constrained_requests, **compiles, **mask.as_dict()}

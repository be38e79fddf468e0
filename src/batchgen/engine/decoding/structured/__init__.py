"""Structured output: constraints (JSON schema, regex, choice, grammar) compiled to token masks.

`StructuredOutputsParams` says what an output must match (vLLM's names; `GuidedDecodingParams` the
older spelling). `GrammarCompiler` compiles it for one tokenizer (cached by spec hash); each request
walks its compiled grammar with a `GrammarState`, which fills its row of a packed int32 bitmask;
`apply_token_bitmask` masks the constrained rows of the logits in place.

The grammar library (llguidance, the `batchgen[structured]` extra) is imported when a grammar is first
compiled, never by importing this package.
"""

from batchgen.engine.decoding.structured.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask,
    bitmask_to_allowed,
)
from batchgen.engine.decoding.structured.compiler import CompiledGrammar, GrammarCompiler
from batchgen.engine.decoding.structured.grammar_state import GrammarState
from batchgen.engine.decoding.structured.library import INSTALL_HINT, StructuredOutputUnavailable
from batchgen.engine.decoding.structured.params import (
    GuidedDecodingParams,
    StructuredOutputError,
    StructuredOutputsParams,
)

__all__ = [
    "INSTALL_HINT",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarState",
    "GuidedDecodingParams",
    "StructuredOutputError",
    "StructuredOutputUnavailable",
    "StructuredOutputsParams",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "bitmask_to_allowed",
]

"""The standalone structured-output layer on the bundled tokenizer: params checks, the compiler and its
cache, a request's grammar state (masks, accepts, rollback, speculative rows), and the bitmask apply.

References no one here wrote: the `jsonschema` package (the records walked are valid), Python's `re`
(which strings a regex constraint accepts), numpy's unpackbits (the packed bitmask's bit order).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
import torch

from batchgen.bench.structured_schemas import WIDE_SCHEMA, wide_instance
from batchgen.engine.decoding.structured import (
    GrammarCompiler,
    GuidedDecodingParams,
    StructuredOutputError,
    StructuredOutputsParams,
    StructuredOutputUnavailable,
    allocate_token_bitmask,
    apply_token_bitmask,
    bitmask_to_allowed,
)
from batchgen.engine.decoding.structured.bitmask import apply_token_bitmask_torch
from batchgen.engine.decoding.structured.library import load_library

VOCAB = 49152  # the bundled SmolLM2's logits width


@pytest.fixture(scope="module")
def tok(hf_tokenizer):
    assert len(hf_tokenizer) == VOCAB
    return hf_tokenizer


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, [tok.eos_token_id])


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def mask_of(state) -> torch.Tensor:
    """(VOCAB,) bool: the tokens the state allows next."""
    bitmask = allocate_token_bitmask(1, VOCAB)
    state.fill_bitmask(bitmask, 0)
    return bitmask_to_allowed(bitmask, VOCAB)[0]


def walk(state, tokens: list[int]) -> None:
    """Every token allowed by the mask filled just before it, then accepted."""
    for i, token in enumerate(tokens):
        assert mask_of(state)[token], f"token {i} ({token}) is valid but masked"
        assert state.accept_token(token), f"token {i} ({token}) refused"


# ---- params ------------------------------------------------------------------------------------
def test_json_string_is_parsed_and_alias_is_the_same_class():
    params = GuidedDecodingParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert GuidedDecodingParams is StructuredOutputsParams
    assert params.json == {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert params.kind == "json"
    assert StructuredOutputsParams(json_object=False, regex="x").kind == "regex"  # False: unset


@pytest.mark.parametrize("kwargs, field, words", [
    ({}, None, "none"),
    ({"json": {"type": "object"}, "regex": "a"}, None, "json, regex"),
    ({"json": "{not json"}, "json", "not valid JSON"),
    ({"json": [1, 2]}, "json", "JSON schema object"),
    ({"choice": []}, "choice", "at least one"),
    ({"choice": "yes"}, "choice", "list of strings"),
    ({"choice": ["yes", ""]}, "choice", "non-empty"),
    ({"regex": ""}, "regex", "non-empty"),
    ({"grammar": "  "}, "grammar", "non-empty"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace", "true or false"),
])
def test_bad_params_name_the_field(kwargs, field, words):
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.field == field
    assert words in str(info.value)
    assert str(info.value).startswith("structured_outputs" + (f".{field}:" if field else ":"))


def test_from_dict_names_an_unknown_key():
    assert StructuredOutputsParams.from_dict({"choice": ["a", "b"]}).choice == ["a", "b"]
    with pytest.raises(StructuredOutputError, match=r"structured_outputs\.jsn: is not a structured_outputs field"):
        StructuredOutputsParams.from_dict({"jsn": {}})


def test_key_is_the_canonical_spec():
    compact = StructuredOutputsParams(json='{"type":"object","properties":{"a":{"type":"integer"}}}')
    spaced = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert compact.key == spaced.key
    assert StructuredOutputsParams(json=spaced.json, disable_any_whitespace=True).key != spaced.key
    # Property order shapes the grammar (properties come out in schema order): a different key.
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    ba = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert StructuredOutputsParams(json=ab).key != StructuredOutputsParams(json=ba).key
    # Whitespace options do not apply to a regex.
    assert StructuredOutputsParams(regex="a", disable_any_whitespace=True).key == StructuredOutputsParams(regex="a").key


# ---- JSON schema -------------------------------------------------------------------------------
def test_schema_first_mask_allows_brace_not_letter(compiler, tok):
    state = compiler.new_state(StructuredOutputsParams(json=WIDE_SCHEMA))
    allowed = mask_of(state)
    assert allowed[tok.convert_tokens_to_ids("{")]
    assert not allowed[tok.convert_tokens_to_ids("a")]
    assert not allowed[tok.eos_token_id]  # nothing emitted yet: the object must come first
    assert 0 < int(allowed.sum()) < 100  # a brace in a few spellings, not the vocabulary


def test_valid_records_walk_to_termination(compiler, tok):
    state0 = compiler.new_state(StructuredOutputsParams(json=WIDE_SCHEMA))
    rng = random.Random(7)
    for _ in range(3):
        record = wide_instance(rng)
        jsonschema.validate(record, WIDE_SCHEMA)  # the reference says the record is valid
        state = compiler.new_state(StructuredOutputsParams(json=WIDE_SCHEMA))
        walk(state, encode(tok, json.dumps(record)))
        assert not state.is_terminated
        end = mask_of(state)
        assert end[tok.eos_token_id] and int(end.sum()) == 1  # complete: only the stop token
        assert state.accept_token(tok.eos_token_id)
        assert state.is_terminated
        assert not state.accept_token(tok.convert_tokens_to_ids("{"))  # nothing after the end
    assert state0.num_tokens == 0  # states of one compiled grammar are independent


def test_invalid_token_is_refused_and_state_kept(compiler, tok):
    state = compiler.new_state(StructuredOutputsParams(json=WIDE_SCHEMA))
    walk(state, encode(tok, '{"id": '))
    before = mask_of(state).clone()
    quote = tok.convert_tokens_to_ids('"')
    assert not before[quote]  # id is an integer
    assert before[tok.convert_tokens_to_ids("4")]
    assert not state.accept_token(quote)
    assert state.num_tokens == len(encode(tok, '{"id": '))
    assert torch.equal(mask_of(state), before)


def test_json_object_and_whitespace_options(compiler, tok):
    anything = StructuredOutputsParams(json_object=True)
    assert compiler.new_state(anything).validate_tokens(encode(tok, '{"a": [1, {"b": null}]}')) == \
        len(encode(tok, '{"a": [1, {"b": null}]}'))
    assert compiler.new_state(anything).validate_tokens(encode(tok, "[1]")) == 0  # an object, not an array
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}

    def accepts(params, text):
        tokens = encode(tok, text) + [tok.eos_token_id]
        return compiler.new_state(params).validate_tokens(tokens) == len(tokens)

    flexible = StructuredOutputsParams(json=schema)
    fixed = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert accepts(flexible, '{"a": 1, "b": 2}') and accepts(fixed, '{"a": 1, "b": 2}')
    assert accepts(flexible, '{\n  "a": 1,\n  "b": 2\n}') and not accepts(fixed, '{\n  "a": 1,\n  "b": 2\n}')
    assert accepts(flexible, '{"a":1,"b":2}') and not accepts(fixed, '{"a":1,"b":2}')
    assert not accepts(flexible, '{"b": 2, "a": 1}')  # properties in the schema's order
    assert not accepts(flexible, '{"a": 1}')  # b is required


def test_objects_are_closed_unless_the_schema_opens_them(compiler, tok):
    def accepts(schema, text):
        tokens = encode(tok, text) + [tok.eos_token_id]
        return compiler.new_state(StructuredOutputsParams(json=schema)).validate_tokens(tokens) == len(tokens)

    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "o": inner}, "required": ["a", "o"]}
    assert accepts(schema, '{"a": 1, "o": {"x": 2}}')
    assert not accepts(schema, '{"a": 1, "o": {"x": 2}, "c": 3}')  # no property the schema does not name
    assert not accepts(schema, '{"a": 1, "o": {"x": 2, "y": 3}}')  # nested objects too
    jsonschema.validate({"a": 1, "o": {"x": 2}, "c": 3}, schema)  # (JSON Schema itself would allow it)
    assert accepts({**schema, "additionalProperties": True}, '{"a": 1, "o": {"x": 2}, "c": 3}')
    assert accepts({**schema, "additionalProperties": {"type": "string"}}, '{"a": 1, "o": {"x": 2}, "c": "s"}')
    assert accepts({"type": "object"}, '{"anything": [1]}')  # an object naming no property stays open
    assert schema["properties"]["o"] == inner and "additionalProperties" not in schema  # the caller's untouched


# ---- regex and choice --------------------------------------------------------------------------
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


@pytest.mark.parametrize("text", ["2024-05-17", "1999-12-31", "2024-13-01", "2024-5-17", "24-05-17", "2024-05-17x",
                                  "date: 2024-05-17", "2024-00-10"])
def test_regex_accepts_what_re_fullmatch_accepts(compiler, tok, text):
    state = compiler.new_state(StructuredOutputsParams(regex=DATE))
    tokens = encode(tok, text) + [tok.eos_token_id]
    is_accepted = state.validate_tokens(tokens) == len(tokens)
    assert is_accepted == (re.fullmatch(DATE, text) is not None)
    if is_accepted:
        walk(state, tokens)
        assert state.is_terminated


def test_choice_outputs_exactly_one_choice(compiler, tok):
    choices = ["positive", "negative", 'say "hi"\n', "café \\o/"]
    params = StructuredOutputsParams(choice=choices)
    for text in choices:
        state = compiler.new_state(params)
        walk(state, encode(tok, text) + [tok.eos_token_id])
        assert state.is_terminated
    for text in ("neutral", "posit", "positive!", "Positive"):
        tokens = encode(tok, text) + [tok.eos_token_id]
        assert compiler.new_state(params).validate_tokens(tokens) < len(tokens), text


def test_grammar_in_ebnf_and_lark(compiler, tok):
    for grammar in ('root ::= "yes" | "no" | "maybe " [0-9]', 'start: "yes" | "no" | "maybe " /[0-9]/'):  # GBNF, Lark
        params = StructuredOutputsParams(grammar=grammar)
        for text, ok in (("yes", True), ("maybe 7", True), ("maybe", False), ("nope", False)):
            tokens = encode(tok, text) + [tok.eos_token_id]
            assert (compiler.new_state(params).validate_tokens(tokens) == len(tokens)) == ok, (grammar, text)


# ---- compile errors and the cache --------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field, words", [
    ({"json": {"type": "foo"}}, "json", "Invalid type: foo"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "json", "minimum (5) is greater than maximum (1)"),
    ({"json": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}, "json", "does not exist"),
    ({"json": {"enum": []}}, "json", "Unsatisfiable"),
    # keywords the library does not implement are refused, never silently dropped
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "json", "uniqueItems"),
    ({"json": {"not": {"type": "integer"}}}, "json", "Unimplemented keys"),
    ({"json": {"type": "string", "format": "credit-card"}}, "json", "Unknown format: credit-card"),
    ({"regex": "(("}, "regex", "unclosed group"),
    ({"regex": "a(?=b)"}, "regex", "look-around"),
    ({"regex": r"[^\x00-\U0010FFFF]"}, "regex", "matches no output"),
    ({"grammar": 'root ::= "a" | undefined_rule'}, "grammar", "undefined_rule"),
    ({"grammar": "start: foo"}, "grammar", "foo"),
])
def test_uncompilable_constraints_name_the_field(compiler, kwargs, field, words):
    params = StructuredOutputsParams(**kwargs)
    for _ in range(2):  # the second time from the cache: the same error
        with pytest.raises(StructuredOutputError) as info:
            compiler.compile(params)
        assert info.value.field == field and words in str(info.value), str(info.value)
        assert "\n" not in str(info.value)


def test_cache_returns_the_same_compiled_grammar_and_is_bounded(tok):
    compiler = GrammarCompiler(tok, VOCAB, [tok.eos_token_id], max_cached=2)
    first = compiler.compile(StructuredOutputsParams(regex="[ab]+"))
    assert compiler.compile(StructuredOutputsParams(regex="[ab]+")) is first
    assert (compiler.stats.num_compiles, compiler.stats.num_cache_hits) == (1, 1)
    with pytest.raises(StructuredOutputError):
        compiler.compile(StructuredOutputsParams(regex="(("))
    with pytest.raises(StructuredOutputError):
        compiler.compile(StructuredOutputsParams(regex="(("))
    assert compiler.stats.num_compiles == 2  # the failure was remembered, not compiled again
    compiler.compile(StructuredOutputsParams(choice=["x"]))  # a third entry: "[ab]+" is the oldest
    assert compiler.num_cached == 2
    again = compiler.compile(StructuredOutputsParams(regex="[ab]+"))
    assert again is not first and compiler.stats.num_compiles == 4


def test_missing_library_names_the_extra(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(StructuredOutputUnavailable, match=r"batchgen\[structured\]"):
        load_library()
    with pytest.raises(StructuredOutputUnavailable, match=r"batchgen\[structured\]"):
        GrammarCompiler(tok, VOCAB, [tok.eos_token_id]).compile(StructuredOutputsParams(regex="a"))


@pytest.mark.subprocess
def test_importing_the_layer_does_not_import_the_library():
    code = ("import sys; from batchgen.engine.decoding.structured import StructuredOutputsParams; "
            "StructuredOutputsParams(json={'type': 'object'}); print('llguidance' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- rollback and speculative rows -------------------------------------------------------------
def test_rollback_restores_the_state(compiler, tok):
    state = compiler.new_state(StructuredOutputsParams(json=WIDE_SCHEMA))
    tokens = encode(tok, json.dumps(wide_instance(random.Random(3))))
    walk(state, tokens[:20])
    at_20 = mask_of(state).clone()
    walk(state, tokens[20:])
    assert state.accept_token(tok.eos_token_id) and state.is_terminated
    state.rollback(len(tokens) - 20 + 1)
    assert not state.is_terminated and state.num_tokens == 20
    assert torch.equal(mask_of(state), at_20)
    walk(state, tokens[20:])  # the same path is open again
    state.rollback(0)
    with pytest.raises(ValueError, match="cannot roll back"):
        state.rollback(len(tokens) + 1)


def test_rollback_over_the_stop_token(compiler, tok):
    """A complete grammar (a choice) and one that could go on (digits) both come back from their end."""
    eos = tok.eos_token_id
    state = compiler.new_state(StructuredOutputsParams(choice=["positive", "negative"]))
    start = mask_of(state).clone()
    tokens = encode(tok, "positive")
    walk(state, tokens)
    complete = mask_of(state).clone()
    assert complete[eos] and int(complete.sum()) == 1
    assert state.accept_token(eos) and state.is_terminated
    state.rollback(1)
    assert not state.is_terminated and torch.equal(mask_of(state), complete)
    assert state.accept_token(eos)
    state.rollback(len(tokens) + 1)
    assert state.num_tokens == 0 and torch.equal(mask_of(state), start)
    digits = compiler.new_state(StructuredOutputsParams(regex=r"\d+"))
    walk(digits, encode(tok, "12"))
    before_stop = mask_of(digits).clone()
    assert before_stop[eos] and int(before_stop.sum()) > 1  # more digits or the end
    assert digits.accept_token(eos) and digits.is_terminated
    digits.rollback(1)
    assert torch.equal(mask_of(digits), before_stop)


def test_draft_rows_are_the_masks_plain_decoding_sees(compiler, tok):
    params = StructuredOutputsParams(json=WIDE_SCHEMA)
    tokens = encode(tok, json.dumps(wide_instance(random.Random(5))))
    state = compiler.new_state(params)
    walk(state, tokens[:10])
    wrong = tok.convert_tokens_to_ids("a")
    drafts = tokens[10:14] + [wrong]
    assert state.validate_tokens(drafts) == 4  # cut at the first draft the grammar refuses
    drafts = drafts[:4]
    bitmask = allocate_token_bitmask(len(drafts) + 2, VOCAB)
    state.fill_bitmask(bitmask, 1, drafts)  # rows 1..5
    assert state.num_tokens == 10 and torch.equal(bitmask[0], torch.full_like(bitmask[0], -1))  # row 0 untouched
    plain = compiler.new_state(params)
    walk(plain, tokens[:10])
    for j in range(len(drafts) + 1):
        expected = allocate_token_bitmask(1, VOCAB)
        plain.fill_bitmask(expected, 0)
        assert torch.equal(bitmask[1 + j], expected[0]), j
        if j < len(drafts):
            assert plain.accept_token(drafts[j])
    assert torch.equal(mask_of(state), bitmask_to_allowed(bitmask[1:2], VOCAB)[0])  # state not moved
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        state.fill_bitmask(bitmask, 0, [wrong])


def test_filling_many_states_in_one_library_call_equals_filling_them_in_turn(compiler, tok):
    """The step's large fills go through the library's thread pool; states with drafts, and a
    terminated one, are filled in turn beside them. Every row equals the row filled alone."""
    from batchgen.engine.decoding.structured.grammar_state import fill_bitmasks
    from batchgen.engine.decoding.structured.library import load_library

    rng = random.Random(3)
    fills, row = [], 0
    for i in range(20):
        state = compiler.new_state(StructuredOutputsParams(json=WIDE_SCHEMA))
        tokens = encode(tok, json.dumps(wide_instance(rng)))
        walk(state, tokens[:5 + 7 * i % 60])
        drafts = tokens[5 + 7 * i % 60:][:2] if i % 5 == 0 else []
        fills.append((state, row, drafts))
        row += 1 + len(drafts)
    done = compiler.new_state(StructuredOutputsParams(choice=["yes"]))
    walk(done, encode(tok, "yes") + [tok.eos_token_id])
    assert done.is_terminated
    fills.append((done, row, []))
    expected = allocate_token_bitmask(row + 2, VOCAB)
    for state, first, drafts in fills:
        state.fill_bitmask(expected, first, drafts)
    together = torch.zeros_like(expected)
    together[row + 1:] = -1  # the spare row, as allocated
    fill_bitmasks(fills, together, load_library().LLExecutor(2))
    assert torch.equal(together, expected)
    assert all(state.num_tokens == n for (state, _, _), n in zip(fills, [5 + 7 * i % 60 for i in range(20)]))


# ---- applying the bitmask ----------------------------------------------------------------------
def _reference_allowed(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    """numpy's own unpacking: each int32 word's little-endian bytes, bits low to high."""
    as_bytes = bitmask.numpy().astype("<i4").view(np.uint8).reshape(bitmask.shape[0], -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab].astype(bool)


def _apply_with(implementation: str):
    if implementation == "torch":
        return apply_token_bitmask_torch
    from batchgen.kernels import cpu_token_bitmask

    assert cpu_token_bitmask.is_available()  # the engine's CPU path: it must build here
    return cpu_token_bitmask.apply_token_bitmask


@pytest.mark.parametrize("implementation", ["c-kernel", "torch"])
@pytest.mark.parametrize("vocab", [VOCAB, VOCAB - 5], ids=["whole-words", "last-word-partial"])
@pytest.mark.parametrize("rows", [[6, 1, 4], list(range(8))], ids=["some-rows", "every-row"])
def test_apply_masks_constrained_rows_and_leaves_the_rest_bit_for_bit(rows, vocab, implementation):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, vocab, generator=gen)  # (N, V)
    if 2 not in rows:
        logits[2, 5] = float("nan")  # an unconstrained row's odd values stay as they are
    rows = torch.tensor(rows)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32,
                            generator=gen)
    bitmask[1] = -1  # a constrained row that allows everything
    bitmask[0, 3] = 0  # a word that allows nothing
    original = logits.clone()
    _apply_with(implementation)(logits, bitmask, rows)
    allowed = _reference_allowed(bitmask, vocab)
    for i, row in enumerate(rows.tolist()):
        expected = torch.where(torch.from_numpy(allowed[i]), original[row], torch.tensor(float("-inf")))
        assert torch.equal(logits[row], expected), row
    untouched = [r for r in range(8) if r not in rows.tolist()]
    assert torch.equal(logits[untouched].view(torch.int32), original[untouched].view(torch.int32))
    assert torch.equal(bitmask_to_allowed(bitmask, vocab), torch.from_numpy(allowed))


def test_apply_off_the_host_copies_nothing_and_reads_nothing():
    """On an accelerator (the meta device stands in, as in the step transfer test) the torch path
    neither copies from the host nor reads a device value: the bitmask's copy is the step's only extra."""
    from tests.engine.runner.test_step_transfers import TransferCounter

    meta = torch.device("meta")
    logits = torch.empty((8, VOCAB), device=meta)
    bitmask = torch.empty((3, VOCAB // 32), dtype=torch.int32, device=meta)
    rows = torch.empty(3, dtype=torch.int32, device=meta)
    with TransferCounter() as counter:
        apply_token_bitmask(logits, bitmask, rows)
    assert counter.transfers == [] and counter.scalar_reads == 0


def test_apply_with_no_constrained_rows_and_bad_shapes():
    logits = torch.randn(4, VOCAB)
    original = logits.clone()
    apply_token_bitmask(logits, torch.empty((0, VOCAB // 32), dtype=torch.int32), torch.empty(0, dtype=torch.long))
    assert torch.equal(logits, original)
    with pytest.raises(ValueError, match="cannot mask"):
        apply_token_bitmask(logits, torch.zeros((1, 10), dtype=torch.int32), torch.tensor([0]))

"""Constraints that crashed or stalled the grammar library are refused before it sees them, and the
compile itself runs on a large-stack thread with a deadline (issue 39's probe: a 1,000-link `$ref`
chain segfaulted the server; `a{1000}{1000}` failed a whole step; 100,000 choices took 7.5 s and
answered with a native backtrace)."""

from __future__ import annotations

import time

import pytest

from batchgen.engine.decoding.structured import compiler as compiler_module
from batchgen.engine.decoding.structured.compiler import GrammarCompiler
from batchgen.engine.decoding.structured.library import library_message
from batchgen.engine.decoding.structured.limits import (
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    check_regex_repeats,
    check_schema_limits,
)
from batchgen.engine.decoding.structured.params import StructuredOutputError, StructuredOutputsParams


def ref_chain(num_links: int) -> dict:
    """d0 -> d1 -> ... -> d<num_links>, each an object with one required property (the probe's schema)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(num_links)}
    defs[f"d{num_links}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    return GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [hf_tokenizer.eos_token_id])


@pytest.mark.parametrize("num_links", [1_000, 5_000])
def test_a_deep_ref_chain_is_refused_by_depth(compiler, num_links):
    start = time.monotonic()
    with pytest.raises(StructuredOutputError, match=f"more than {MAX_SCHEMA_DEPTH} deep") as info:
        compiler.compile(StructuredOutputsParams(json=ref_chain(num_links)))
    assert info.value.field == "json" and time.monotonic() - start < 2.0


def test_the_depth_is_the_longest_path_with_refs_followed():
    check_schema_limits(ref_chain(MAX_SCHEMA_DEPTH // 2 - 2))  # two levels per link: within the bound
    with pytest.raises(StructuredOutputError):
        check_schema_limits(ref_chain(MAX_SCHEMA_DEPTH // 2 + 1))
    nested = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):  # nesting without any $ref counts the same
        nested = {"type": "array", "items": nested}
    with pytest.raises(StructuredOutputError):
        check_schema_limits(nested)


def test_recursive_types_and_shared_definitions_pass():
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    check_schema_limits(tree)  # a reference back to a schema on the path is a rule, not a deeper level
    # 60 levels each referring to the next twice: 2^60 paths, walked once per definition.
    defs = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]} for i in range(60)}
    defs["l60"] = {"type": "integer"}
    start = time.monotonic()
    check_schema_limits({"$ref": "#/$defs/l0", "$defs": defs})
    assert time.monotonic() - start < 0.5


@pytest.mark.parametrize("regex, product", [("a{1000}{1000}", 1_000_000), ("(a{100}){101}", 10_100),
                                            ("(x|(ab){20}){600}", 12_000), ("a{2,}{6000}", 12_000)])
def test_nested_repetition_bounds_multiply(regex, product):
    with pytest.raises(StructuredOutputError, match=f"repeats {product:,} times"):
        check_regex_repeats(regex)


@pytest.mark.parametrize("regex", ["(a{100}){100}", r"\{5000}x{3}", "[{]{9999}", "a{10000}", r"\d{3}-\d{4}"])
def test_bounds_within_the_limit_and_escaped_braces_pass(regex):
    check_regex_repeats(regex)


def test_the_probe_regex_and_choice_list_are_refused_quickly(compiler):
    with pytest.raises(StructuredOutputError, match="regex"):
        compiler.compile(StructuredOutputsParams(regex="a{1000}{1000}"))
    start = time.monotonic()
    with pytest.raises(StructuredOutputError, match=f"at most {MAX_CHOICES:,}"):
        compiler.compile(StructuredOutputsParams(choice=[f"option {i}" for i in range(100_000)]))
    assert time.monotonic() - start < 1.0


def test_the_large_stack_alone_compiles_what_crashed_the_process(hf_tokenizer, monkeypatch):
    """With the limits switched off, the 1,000-link chain that overflowed the native stack compiles on the
    compile thread's stack (the limits are a bound on time and memory, not the only guard)."""
    monkeypatch.setattr(compiler_module, "check_constraint_limits", lambda params: None)
    fresh = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [hf_tokenizer.eos_token_id])
    grammar = fresh.compile(StructuredOutputsParams(json=ref_chain(1_000)))
    assert grammar.kind == "json"


def test_a_compile_past_its_deadline_is_refused_and_remembered(hf_tokenizer):
    slow = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [hf_tokenizer.eos_token_id], compile_timeout_s=0.05)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3_000)}}
    with pytest.raises(StructuredOutputError, match="longer than 0.05 s"):
        slow.compile(StructuredOutputsParams(json=schema))
    start = time.monotonic()
    with pytest.raises(StructuredOutputError, match="longer than"):  # the failure is cached: no second wait
        slow.compile(StructuredOutputsParams(json=schema))
    assert time.monotonic() - start < 0.05


def test_a_native_panic_reads_without_its_backtrace():
    text = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n"
            "   0: <unknown>\n  16: type_call at /tmp/python-build/Objects/typeobject.c:1091:11")
    assert library_message(text) == "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10"

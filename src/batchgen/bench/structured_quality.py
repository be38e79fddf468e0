"""Do constrained outputs satisfy their constraint? Chat prompts x JSON schemas, a date regex, a choice list.

`python -m batchgen.bench.structured_quality [--num-prompts 200] [--json]`

The bundled chat prompts (jobs/data/chat_prompts.parquet, cycled to `num_prompts`), each given a
short system instruction to answer in JSON with a schema's fields, run four ways in ONE engine batch
per temperature (greedy, and sampled at 0.8 with a seed): constrained by the row's schema (the rows
take the 5 schemas in turn), the same prompts unconstrained, a date regex, a choice list. Every
output that finished with `stop` is checked with the `jsonschema` package (the regex with Python's
`re.fullmatch`, the choice by membership); an output cut by max_tokens (`length`) is counted apart.
The unconstrained rows show that the constraint does the work: without it the same prompts rarely
give a valid record.

The schemas cover what a synthesis record uses: nested objects, arrays with minItems, enums, numbers
with bounds, required fields and a string pattern. Strings and arrays carry a maxLength / maxItems:
a small model otherwise repeats an array item or a word until max_tokens (still valid JSON, but cut).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.bench.workloads import default_chat_prompts_path
from batchgen.engine import LLMEngine, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "country": {"enum": ["France", "Germany", "Japan", "USA", "Other"]}},
            "required": ["city", "country"],
        },
    },
    "required": ["name", "age", "address"],
}
KEYWORDS = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 30},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 4},
    },
    "required": ["topic", "keywords"],
}
VERDICT = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["helpful", "unhelpful", "unsure"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["verdict", "confidence"],
}
MEASURES = {
    "type": "object",
    "properties": {
        "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100},
        "wind_kmh": {"type": "number", "minimum": 0, "maximum": 300},
    },
    "required": ["temperature_c", "humidity_pct", "wind_kmh"],
}
TICKET = {
    "type": "object",
    "properties": {
        "ticket": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "title": {"type": "string", "maxLength": 40},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "labels": {"type": "array", "items": {"enum": ["bug", "feature", "question"]}, "minItems": 1,
                   "maxItems": 3},
    },
    "required": ["ticket", "title", "priority"],
}
# name -> (the system instruction, the schema)
SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": ("Answer with a JSON object describing a person: name, age and address (city, country).", PERSON),
    "keywords": ("Answer with a JSON object: the topic of the question and a list of keywords.", KEYWORDS),
    "verdict": ("Answer with a JSON object: your verdict (helpful, unhelpful or unsure) on whether you can "
                "help, and your confidence from 0 to 1.", VERDICT),
    "measures": ("Answer with a JSON object of weather measures: temperature_c, humidity_pct, wind_kmh.", MEASURES),
    "ticket": ("Answer with a JSON object filing a support ticket: ticket id like ABC-1234, title, priority "
               "1-5, labels.", TICKET),
}
DATE_REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
DATE_INSTRUCTION = "Answer with one date in the form YYYY-MM-DD."
CHOICES = ["positive", "negative", "neutral"]
CHOICE_INSTRUCTION = "Is the tone of this message positive, negative or neutral? Answer with one word."
KINDS = ("schema", "unconstrained", "regex", "choice")


def chat_prompts(path: str | Path | None = None) -> list[list[dict]]:
    """The bundled chat prompts' message lists (jobs/data/chat_prompts.parquet)."""
    import pyarrow.parquet as pq

    if path is None:
        path = default_chat_prompts_path()
    return [list(row) for row in pq.read_table(path, columns=["messages"]).column("messages").to_pylist()]


@dataclass
class Request:
    request_id: str
    kind: str  # schema | unconstrained | regex | choice
    schema_name: str | None
    messages: list[dict]
    params: SamplingParams


@dataclass
class KindResult:
    """Outputs of one kind at one temperature: how many, how they finished, how many are valid."""

    num_requests: int = 0
    num_stop: int = 0
    num_length: int = 0
    num_valid_stop: int = 0  # of the `stop` outputs, those the constraint's check accepts
    num_tokens: int = 0
    invalid_examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"num_requests": self.num_requests, "num_stop": self.num_stop, "num_length": self.num_length,
                "num_valid_stop": self.num_valid_stop, "num_tokens": self.num_tokens,
                "valid_fraction_of_stop": self.num_valid_stop / self.num_stop if self.num_stop else None,
                "invalid_examples": self.invalid_examples[:3]}


def build_requests(prompts: list[list[dict]], num_prompts: int, temperature: float, max_tokens: int,
                   seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[Request]:
    """`num_prompts` prompts (cycled) for each kind: the schema rows take the schemas in turn and the
    unconstrained rows are the same prompts without the constraint."""
    names = list(SCHEMAS)
    requests = []
    tag = f"t{temperature:g}"
    for i in range(num_prompts):
        chat = [m for m in prompts[i % len(prompts)] if m["role"] != "system"]
        name = names[i % len(names)]
        instruction, schema = SCHEMAS[name]
        base = {"temperature": temperature, "max_tokens": max_tokens, "seed": seed if temperature else None}
        with_system = [{"role": "system", "content": instruction}, *chat]
        if "schema" in kinds:
            requests.append(Request(f"{tag}-schema-{i}", "schema", name, with_system,
                                    SamplingParams(**base, structured_outputs={"json": schema})))
        if "unconstrained" in kinds:
            requests.append(Request(f"{tag}-free-{i}", "unconstrained", name, with_system, SamplingParams(**base)))
        if "regex" in kinds:
            requests.append(Request(f"{tag}-regex-{i}", "regex", None,
                                    [{"role": "system", "content": DATE_INSTRUCTION}, *chat],
                                    SamplingParams(**base, structured_outputs={"regex": DATE_REGEX})))
        if "choice" in kinds:
            requests.append(Request(f"{tag}-choice-{i}", "choice", None,
                                    [{"role": "system", "content": CHOICE_INSTRUCTION}, *chat],
                                    SamplingParams(**base, structured_outputs={"choice": CHOICES})))
    return requests


def is_valid(request: Request, text: str) -> bool:
    """Does `text` satisfy the request's constraint (for an unconstrained row: its prompt's schema)?"""
    if request.kind in ("schema", "unconstrained"):
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), SCHEMAS[request.schema_name][1])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if request.kind == "regex":
        return re.fullmatch(DATE_REGEX, text) is not None
    return text in CHOICES


def run_requests(engine: LLMEngine, requests: list[Request]) -> dict:
    """Every request in one engine batch; returns {kind: KindResult} and the seconds it took."""
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r.request_id, r.messages, r.params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    seconds = time.perf_counter() - start
    results = {kind: KindResult() for kind in dict.fromkeys(r.kind for r in requests)}
    texts = {}
    for r in requests:
        result = results[r.kind]
        completion = outputs[r.request_id].outputs[0]
        texts[r.request_id] = completion.text
        result.num_requests += 1
        result.num_tokens += len(completion.token_ids)
        if completion.finish_reason == "length":
            result.num_length += 1
        elif completion.finish_reason == "stop":
            result.num_stop += 1
            if is_valid(r, completion.text):
                result.num_valid_stop += 1
            else:
                result.invalid_examples.append(completion.text)
    return {"results": results, "seconds": seconds, "texts": texts}


def run_structured_quality(engine: LLMEngine, num_prompts: int = 200, max_tokens: int = 96,
                           temperatures: tuple[float, ...] = (0.0, 0.8), seed: int = 0,
                           prompts_path: str | None = None) -> dict:
    """Per temperature: each kind's KindResult (as a dict), the batch's seconds and the engine's
    structured-output counters over it."""
    prompts = chat_prompts(prompts_path)
    report: dict = {"num_prompts": num_prompts, "max_tokens": max_tokens, "seed": seed, "temperatures": {}}
    for temperature in temperatures:
        before = engine.stats["structured"]
        ran = run_requests(engine, build_requests(prompts, num_prompts, temperature, max_tokens, seed))
        after = engine.stats["structured"]
        steps = after["num_masked_steps"] - before["num_masked_steps"]
        report["temperatures"][f"{temperature:g}"] = {
            "seconds": ran["seconds"],
            "kinds": {kind: result.as_dict() for kind, result in ran["results"].items()},
            "mask_ms_per_step": 1000 * (after["mask_seconds"] - before["mask_seconds"]) / steps if steps else 0.0,
            "masked_rows_per_step": (after["num_masked_rows"] - before["num_masked_rows"]) / steps if steps else 0.0,
        }
    return report


def format_report(report: dict) -> str:
    lines = [f"{report['num_prompts']} prompts per kind, max_tokens {report['max_tokens']}",
             f"{'T':>4} {'kind':<14} {'stop':>5} {'valid':>6} {'length':>6} {'tokens':>7}"]
    for temperature, entry in report["temperatures"].items():
        for kind, r in entry["kinds"].items():
            lines.append(f"{temperature:>4} {kind:<14} {r['num_stop']:>5} {r['num_valid_stop']:>6} "
                         f"{r['num_length']:>6} {r['num_tokens']:>7}")
        lines.append(f"     batch {entry['seconds']:.1f} s; mask {entry['mask_ms_per_step']:.2f} ms per step "
                     f"({entry['masked_rows_per_step']:.0f} constrained rows per step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgen.bench.structured_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="1536MiB", help="the engine's KV pool (128 running requests)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    from batchgen.engine import EngineConfig

    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu", num_threads=args.threads,
                                    max_model_len=2048, kv_cache_memory=args.kv_cache_memory))
    report = run_structured_quality(engine, args.num_prompts, args.max_tokens, seed=args.seed)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An OpenAI batch file of 40 requests through `batchgen run` on the bundled model, killed with SIGKILL
mid-job and rerun: 37 response lines that the `openai` package's types parse, 3 error lines naming
the problem, every custom_id exactly once (issue 17)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import yaml
from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchgen.engine import SamplingParams
from batchgen.pipeline.config import load_job
from batchgen.pipeline.job import run_job
from tests.conftest import MODEL
from tests.pipeline.cli_process import batchgen, part_files, sigkill_after_first_part
from tests.pipeline.conftest import engine_sections, read_output
from tests.pipeline.test_openai_batch import CHAT, COMPLETIONS, line, read_jsonl, write_lines

pytestmark = pytest.mark.subprocess

NUM_LINES, NUM_UNITS = 40, 10
BAD = {  # custom_id -> (the line, the field its error names, words of its message)
    # a schema the grammar library refuses: the line's error, found when its window is read ahead
    "bad-json-schema": (line("bad-json-schema", response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "required": ["a"],
                                "properties": {"a": {"type": "integer", "minimum": 2, "maximum": 1}}}}}),
        "response_format.json_schema.schema", "nsatisfiable"),
    "bad-temperature": (line("bad-temperature", COMPLETIONS, temperature=5000), "temperature", "must be in"),
    "bad-url": (line("bad-url", "/v1/embeddings", input="hello"), "url", "/v1/embeddings"),
}


def request_lines() -> list[dict]:
    """Chat and completions requests with every kind of setting; the 3 bad ones spread through the file."""
    lines = []
    for i in range(NUM_LINES - len(BAD)):
        cid = f"req-{i:02d}"
        kind = i % 5
        if kind == 0:
            lines.append(line(cid, messages=[{"role": "user", "content": f"Say a word about {i}."}]))
        elif kind == 1:
            lines.append(line(cid, temperature=0.8, n=2, seed=i, max_completion_tokens=2))
        elif kind == 2:
            lines.append(line(cid, COMPLETIONS, prompt=f"Count: {i},", stop=["\n"]))
        elif kind == 3:
            lines.append(line(cid, logprobs=True, top_logprobs=2, model="gpt-4o-mini"))
        else:
            lines.append(line(cid, COMPLETIONS, prompt=f"Number {i} is", logprobs=1, temperature=0.5, seed=3))
    for position, (raw, _, _) in zip((3, 17, 31), BAD.values()):
        lines.insert(position, raw)
    return lines


def test_batch_file_killed_mid_job_then_rerun_writes_each_custom_id_once(tmp_path, llm, engine):
    lines = request_lines()
    write_lines(tmp_path / "requests.jsonl", lines)
    job = {
        "name": "batch", **engine_sections(),  # the shared engine's settings: the rerun runs on it
        "input": {"path": "requests.jsonl", "rows_per_unit": NUM_LINES // NUM_UNITS},
        "sampling": {"max_tokens": 2},  # what a body leaves out
        "batching": {"window": 8},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = tmp_path / "out" / "batch"

    # Eight sequences at a time (an engine knob, outside the config hash): two units at a time, in
    # order, so the kill lands between units.
    done_before = sigkill_after_first_part(batchgen("run", str(tmp_path / "job.yaml"), "--no-progress",
                                                    "--set", "engine.max_num_seqs=8"), out)
    assert 0 < len(done_before) < NUM_UNITS
    assert not (out / "_SUCCESS").exists() and not (out / "output.jsonl").exists()

    # The rerun: the same job on the session's engine (a second model load in a subprocess would
    # double the test's time; the CLI's exit codes and resume messages are test_resume.py's).
    result = run_job(load_job(tmp_path / "job.yaml"), engine=engine, progress=False)
    assert result.num_units_skipped == len(done_before) and result.num_units_run == NUM_UNITS - len(done_before)
    after = part_files(out)
    assert {name: after[name] for name in done_before} == done_before  # finished parts were not rewritten

    ok, errors = read_jsonl(out / "output.jsonl"), read_jsonl(out / "errors.jsonl")
    assert Counter(x["custom_id"] for x in ok + errors) == Counter(x["custom_id"] for x in lines)  # each once
    assert len(ok) == NUM_LINES - len(BAD) and len(errors) == len(BAD)
    sent = {x["custom_id"]: x for x in lines}
    for x in ok:
        assert x["response"]["status_code"] == 200 and x["error"] is None
        body, request = x["response"]["body"], sent[x["custom_id"]]
        if request["url"] == CHAT:
            parsed = ChatCompletion.model_validate(body)
            texts = [c.message.content for c in parsed.choices]
        else:
            parsed = Completion.model_validate(body)
            texts = [c.text for c in parsed.choices]
        assert parsed.model == MODEL  # the job's model ran, whatever the line named
        assert len(parsed.choices) == request["body"].get("n", 1)
        assert all(isinstance(t, str) for t in texts)
        assert 1 <= parsed.usage.completion_tokens <= 2 * len(parsed.choices)
        assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
        if request["body"].get("top_logprobs"):  # chat: each token with its 2 most likely
            content = parsed.choices[0].logprobs.content
            assert len(content) == parsed.usage.completion_tokens
            assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
        elif request["body"].get("logprobs") == 1:  # completions: tokens and their log-probabilities
            logprobs = parsed.choices[0].logprobs
            assert len(logprobs.tokens) == len(logprobs.token_logprobs) == parsed.usage.completion_tokens
        else:
            assert parsed.choices[0].logprobs is None
    # A line's settings are its own: a seeded sampled chat line and a greedy completions line give what
    # LLM.generate gives for the same messages/prompt and settings (a seed draws by (seed, sample index)).
    by_id = {x["custom_id"]: x["response"]["body"]["choices"] for x in ok}
    seeded = llm.generate([sent["req-01"]["body"]["messages"]],
                          SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=2))[0]
    assert [c["message"]["content"] for c in by_id["req-01"]] == [c.text for c in seeded.outputs]
    greedy = llm.generate(["Count: 2,"], SamplingParams(temperature=0, max_tokens=2, stop=["\n"]))[0]
    assert by_id["req-02"][0]["text"] == greedy.outputs[0].text
    for x in errors:
        _, param, words = BAD[x["custom_id"]]
        error = x["response"]["body"]["error"]
        assert x["response"]["status_code"] == 400 and error["param"] == param and words in error["message"]

    rows = read_output(out)
    pairs = Counter(zip(rows.column("id").to_pylist(), rows.column("sample_index").to_pylist()))
    assert pairs == Counter({(x["custom_id"], s): 1 for x in lines for s in range(x["body"].get("n", 1))})
    success = json.loads((out / "_SUCCESS").read_text())
    assert success == result.record.to_dict() and success["resumed"] is True and success["num_requests"] == NUM_LINES
    assert success["num_errors"] == len(BAD)

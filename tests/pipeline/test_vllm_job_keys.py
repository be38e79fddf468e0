"""The job keys a vLLM user looks for: input.chat_template and chat_template_kwargs, model.generation_config
(defaults for the sampling keys a job does not set, recorded in _SUCCESS), the config hash of jobs that
leave them alone; and the progress bar's rate against the run's summary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import pyarrow.parquet as pq
import pytest

from batchgen.engine import SamplingParams
from batchgen.pipeline.config import validate_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from tests.pipeline.conftest import make_job, write_parquet

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}{{ greeting | default('') }}assistant:{% endif %}")
PROMPTS = ["Name a fruit.", "Name a color."]


@pytest.fixture
def inputs(tmp_path) -> str:
    return str(write_parquet(tmp_path / "in.parquet", {"id": [1, 2], "prompt": PROMPTS}))


def test_a_jobs_chat_template_file_and_kwargs_render_its_prompts(engine, llm, tmp_path, inputs):
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    job = make_job(tmp_path, inputs, input={"chat_template": "chat.jinja",  # relative to the job's folder
                                            "chat_template_kwargs": {"greeting": "Ahoy "}})
    assert job.input.chat_template == TEMPLATE
    run_job(job, engine=engine, progress=False)
    rows = pq.read_table(tmp_path / "out" / "part-00000.parquet").to_pylist()
    # The reference: jinja2 itself renders the template; the tokenizer encodes it as a rendered chat.
    hf = engine.tokenizer.hf
    rendered = [jinja2.Template(TEMPLATE).render(messages=[{"role": "user", "content": p}],
                                                 add_generation_prompt=True, greeting="Ahoy ") for p in PROMPTS]
    assert rendered[0] == "user: Name a fruit.\nAhoy assistant:"
    ids = [hf.encode(text, add_special_tokens=False) for text in rendered]
    assert [r["prompt_tokens"] for r in rows] == [len(i) for i in ids]
    expected = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0, max_tokens=4))
    assert [r["completion_token_ids"] for r in rows] == [e.outputs[0].token_ids for e in expected]


def test_a_chat_template_that_cannot_work_fails_the_job_before_any_row(engine, tmp_path, inputs):
    with pytest.raises(JobError, match=r"input.chat_template: chat template 'missing.jinja' looks like a file path"):
        make_job(tmp_path, inputs, input={"chat_template": "missing.jinja"})
    with pytest.raises(JobError, match="input.chat_template: the chat template does not parse: line 1"):
        make_job(tmp_path, inputs, input={"chat_template": "{% for m in messages %}"})
    with pytest.raises(JobError, match="chat_template_kwargs cannot set tokenize"):
        make_job(tmp_path, inputs, input={"chat_template_kwargs": {"tokenize": True}})
    job = make_job(tmp_path, inputs, input={"chat_template": "{{ raise_exception('no user turns') }}"})
    with pytest.raises(JobError, match="input.chat_template: the chat template does not render a user message.*"
                                       "no user turns"):
        run_job(job, engine=engine, progress=False)
    assert not (tmp_path / "out" / "part-00000.parquet").exists()


def test_generation_config_gives_beam_search_only_its_max_new_tokens(tmp_path, inputs):
    from batchgen.pipeline.job_plan import plan_job

    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9,
                                                                 "max_new_tokens": 3}))
    job = make_job(tmp_path, inputs, model={"generation_config": "gen"}, sampling={"beam_width": 2, "max_tokens": 4})
    job.sampling.model_fields_set.discard("max_tokens")  # as if the job file left it unset
    plan_job(job)  # beam search samples nothing: the file's temperature and top_p do not refuse it
    assert job.generation_config_record["applied"] == {"max_tokens": 3}
    assert (job.sampling.temperature, job.sampling.top_p) == (0.0, 1.0)


def test_generation_config_fills_the_sampling_keys_the_job_does_not_set(engine, llm, tmp_path, inputs):
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(
        {"repetition_penalty": 1.3, "top_k": 5, "max_new_tokens": 3, "do_sample": False}))
    plain = make_job(tmp_path, inputs, output={"path": str(tmp_path / "plain")})
    job = make_job(tmp_path, inputs, model={"generation_config": "gen"})  # relative to the job's folder
    record = run_job(job, engine=engine, progress=False).record
    # The job sets max_tokens (4): only the keys it leaves unset take the file's values.
    assert record.generation_config.to_dict() == {"setting": str(folder), "file": str(folder / "generation_config.json"),
                                                  "applied": {"repetition_penalty": 1.3, "top_k": 5}}
    assert record.config_hash != plain.config_hash()
    rows = pq.read_table(tmp_path / "out" / "part-00000.parquet").to_pylist()
    expected = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3, top_k=5))
    assert [r["completion_token_ids"] for r in rows] == [e.outputs[0].token_ids for e in expected]
    assert plain.generation_config_record == {"setting": "vllm", "file": None, "applied": {}}

    (folder / "generation_config.json").write_text(json.dumps({"temperature": 500.0}))
    with pytest.raises(JobError, match=r"model.generation_config: .*generation_config.json gives "
                                       r"sampling.temperature 500.0, which must be in \[1e-5, 100\] or 0"):
        run_job(make_job(tmp_path, inputs, model={"generation_config": "gen"}, output={"path": str(tmp_path / "o3")}),
                engine=engine, progress=False)
    with pytest.raises(JobError, match="model.generation_config: .*no generation_config.json there"):
        run_job(make_job(tmp_path, inputs, model={"generation_config": "nowhere"}), engine=engine, progress=False)


def test_a_job_that_leaves_the_new_keys_alone_keeps_its_config_hash():
    # The hash batchgen gave this job before model.revision, model.generation_config, input.chat_template,
    # input.chat_template_kwargs and sampling.include_stop_str_in_output existed: its folders still resume.
    raw = {"name": "t", "model": {"path": "smollm2-135m-instruct"},
           "input": {"path": "/data/in.parquet", "messages_column": "messages"},
           "sampling": {"stop": ["END"], "max_tokens": 32}, "output": {"path": "/out/t"}}
    job = validate_job(raw, Path("/jobs"))
    assert job.config_hash() == "4565c532fe1d71f66e19541e826fd85e4ee02cee19c7867c308bee77fcd4a4bc"
    changed = [{"model": {**raw["model"], "revision": "v2"}}, {"model": {**raw["model"], "generation_config": "auto"}},
               {"input": {**raw["input"], "chat_template_kwargs": {"enable_thinking": False}}},
               {"input": {**raw["input"], "chat_template": "{{ messages }}"}},
               {"sampling": {**raw["sampling"], "include_stop_str_in_output": True}}]
    hashes = {validate_job({**raw, **change}, Path("/jobs")).config_hash() for change in changed}
    assert len(hashes) == len(changed) and job.config_hash() not in hashes


def test_the_progress_bars_last_rate_agrees_with_the_summary(engine, tmp_path, capsys):
    inputs = write_parquet(tmp_path / "in.parquet", {"id": list(range(6)), "prompt": [f"Count to {i}." for i in range(6)]})
    job = make_job(tmp_path, str(inputs), sampling={"max_tokens": 8})
    record = run_job(job, engine=engine, progress=True).record
    rates = re.findall(r"([\d,]+\.\d) tok/s", capsys.readouterr().err)
    assert rates, "the bar showed no rate"
    shown = float(rates[-1].replace(",", ""))
    assert record.completion_tokens > 0
    assert abs(shown - record.completion_tokens_per_s) <= 0.1 * record.completion_tokens_per_s

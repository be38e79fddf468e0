"""`batchgen validate` at scale (issue 40): the units in a few lines whatever their number, and `--tokenize`
counting the rows too long for the context before any weight loads, as transformers' own chat template
and tokenizer count them."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import main as cli
from tests.pipeline.conftest import write_parquet

MAX_MODEL_LEN = 256
MAX_TOKENS = 64


@pytest.fixture
def no_weights(monkeypatch):
    from batchgen.engine.runner import executor

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(executor, "load_model", refuse)


def _job_file(tmp_path, model, prompts: list[str], **input_section) -> str:
    """A job on the tiny model (an HF folder with the bundled model's tokenizer: it loads in a moment)."""
    write_parquet(tmp_path / "data" / "in.parquet", {"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts})
    raw = {"name": "tok-job", "model": {"path": str(model), "dtype": "float32", "max_model_len": MAX_MODEL_LEN},
           "engine": {"device": "cpu", "kv_cache_memory": "8MiB"},
           "input": {"path": "data/in.parquet", **input_section}, "sampling": {"max_tokens": MAX_TOKENS}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _validate(*args: str):
    result = CliRunner().invoke(cli.app, ["validate", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_a_thousand_units_take_three_lines(tmp_path, tiny_model, no_weights):
    path = _job_file(tmp_path, tiny_model, [f"p{i}" for i in range(1000)], rows_per_unit=1)
    out = _validate(path)
    unit_lines = [line for line in out.splitlines() if line.startswith("  ")]
    data = tmp_path / "data" / "in.parquet"
    assert unit_lines == [f"  part-00000.parquet  {data} rows 0-0",
                          "  ... 998 more unit(s) over 1 file(s)",
                          f"  part-00999.parquet  {data} rows 999-999"]
    assert len(out.splitlines()) <= 10 and "units    1000 of <= 1 rows" in out


def _chat_tokens(hf, text: str) -> int:
    """The prompt's length as transformers renders and tokenizes the chat (the reference)."""
    return len(hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False))


@pytest.mark.parametrize("on_overlong", ["error", "truncate_left"])
def test_tokenize_counts_the_overlong_rows_as_transformers_does(tmp_path, tiny_model, no_weights, on_overlong):
    from transformers import AutoTokenizer

    # Lengths around the limit: prompt tokens + 64 against 256 (some fit, some do not, by a few tokens).
    prompts = [("word " * n).strip() for n in (1, 150, 170, 180, 185, 190, 200, 260, 20, 175)]
    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    expected = [_chat_tokens(hf, p) for p in prompts]
    num_overlong = sum(n + MAX_TOKENS > MAX_MODEL_LEN for n in expected)
    assert 0 < num_overlong < len(prompts)  # the case is not degenerate
    out = _validate(_job_file(tmp_path, tiny_model, prompts, on_overlong=on_overlong), "--tokenize")
    longest = max(expected)
    assert (f"tokens   10 rows tokenized: prompt tokens mean {sum(expected) / 10:,.0f}, longest {longest} "
            f"(id r{expected.index(longest)}); max_model_len {MAX_MODEL_LEN}") in out
    fate = "error rows (input.on_overlong: error)" if on_overlong == "error" else "cut to their last tokens"
    assert f"{num_overlong} overlong row(s), prompt tokens + max_tokens > max_model_len: {fate}" in out
    first = next(i for i, n in enumerate(expected) if n + MAX_TOKENS > MAX_MODEL_LEN)
    assert f"first: r{first}: overlong prompt: {expected[first]} prompt tokens + max_tokens {MAX_TOKENS}" in out
    assert out.rstrip().endswith("ok")


def test_tokenize_counts_rows_over_max_prompt_bytes_and_says_when_every_row_fits(tmp_path, tiny_model, no_weights):
    out = _validate(_job_file(tmp_path, tiny_model, ["short", "x" * 300, "also short"], max_prompt_bytes=100),
                    "--tokenize")
    assert "1 row(s) over input.max_prompt_bytes: error rows" in out and "overlong" not in out
    out = _validate(_job_file(tmp_path, tiny_model, ["short", "also short"]), "--tokenize")
    assert "every row fits: prompt tokens + max_tokens <= max_model_len" in out

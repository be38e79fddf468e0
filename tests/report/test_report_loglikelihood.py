"""The report of a real `task: loglikelihood` output (the bundled model scoring 3 continuations of 4
contexts): `batchgen run --report` and `batchgen report` exit 0 with no latency column assumed (its rows
have no token times), choice accuracy scored post hoc equals the argmax taken by hand, and `--against` a
copy with one row's log-probabilities changed lists that row as flipped, with both runs' answers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import main as cli
from tests.pipeline.conftest import engine_sections, read_output, write_parquet
from tests.report.conftest import REPORT_ENGINE_KWARGS
from tests.report.html_cells import keyed_cells

CONTEXTS = ["The cat sat on the", "My neighbour waited near the", "A small boat sailed across the",
            "The old king looked at the"]
CHOICES = [" mat", " door of the house", " sea"]
ACC = "acc={type: choice_accuracy, label_column: label}"
ACC_NORM = "acc_norm={type: choice_accuracy_norm, label_column: label}"


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory, report_engine):
    """The job run by `batchgen run --report` (on the session's engine): it exits 0 and writes the page."""
    from batchgen.pipeline import job_engine

    tmp = tmp_path_factory.mktemp("loglikelihood-run")
    write_parquet(tmp / "in.parquet", {"id": list(range(len(CONTEXTS))), "prompt": CONTEXTS,
                                       "choices": [CHOICES] * len(CONTEXTS),
                                       "label": [i % 3 for i in range(len(CONTEXTS))]})
    raw = {"name": "mc", "task": "loglikelihood", **engine_sections(REPORT_ENGINE_KWARGS),
           "input": {"path": "in.parquet", "continuations_column": "choices", "apply_chat_template": False,
                     "rows_per_unit": 2},
           "output": {"path": "out", "keep_columns": ["label", "choices"]}}
    (tmp / "job.yaml").write_text(yaml.safe_dump(raw))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(job_engine, "engine_for", lambda job, engine: report_engine)
        done = CliRunner().invoke(cli.app, ["run", str(tmp / "job.yaml"), "--report", "--no-progress"])
    assert done.exit_code == 0, done.output
    assert "its report failed" not in done.output and (tmp / "out" / "report.html").exists()
    return tmp / "out"


def by_hand(rows: list[dict], is_normalised: bool) -> float:
    """lm-eval's acc / acc_norm: the argmax of the log-probabilities (acc_norm: per character of the choice,
    the continuation without lm-eval's target delimiter " ")."""
    right = []
    for r in rows:
        scores = np.array(r["continuation_logprob"])
        if is_normalised:
            scores = scores / np.array([len(c.removeprefix(" ")) for c in r["choices"]])
        right.append(int(np.argmax(scores)) == r["label"])
    return float(np.mean(right))


def test_a_loglikelihood_output_reports_with_its_scores(scored_run, tmp_path):
    page = tmp_path / "page.html"
    done = CliRunner().invoke(cli.app, ["report", str(scored_run), "--metric", ACC, "--metric", ACC_NORM,
                                        "--continuations-column", "choices", "-o", str(page), "--json"])
    assert done.exit_code == 0, done.output
    scores = json.loads(done.stdout)["scores"]
    rows = read_output(scored_run).to_pylist()
    assert "ttft_s" not in rows[0] and "completion" not in rows[0]  # the premise: no token times, no text
    assert scores["acc"]["value"] == pytest.approx(by_hand(rows, False)) and scores["acc"]["n"] == len(CONTEXTS)
    assert scores["acc_norm"]["value"] == pytest.approx(by_hand(rows, True))
    assert by_hand(rows, True) != by_hand(rows, False) or by_hand(rows, False) not in (0.0, 1.0)
    html = page.read_text()
    assert set(keyed_cells(html, "latency-table")) == {"queue_s", "e2e_s"}
    assert 'data-plot="ttft"' not in html and 'data-plot="e2e"' in html
    assert keyed_cells(html, "scores-table")["acc"][2] == f"{by_hand(rows, False):.4f}"
    assert keyed_cells(html, "summary-table")["num_rows"][-1] == str(len(CONTEXTS))

    unnamed = CliRunner().invoke(cli.app, ["report", str(scored_run), "--metric", ACC_NORM, "-o", str(page)])
    assert unnamed.exit_code == 2 and "--continuations-column" in unnamed.output


def test_against_a_run_with_one_row_changed_lists_it(scored_run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(scored_run, other)
    part = other / "part-00000.parquet"
    table = pq.read_table(part)
    logprobs = table.column("continuation_logprob").to_pylist()
    label = table.column("label")[1].as_py()
    was_right = int(np.argmax(logprobs[1])) == label
    wrong = (label + 1) % 3
    logprobs[1] = [0.0 if k == (wrong if was_right else label) else -50.0 for k in range(3)]
    index = table.schema.get_field_index("continuation_logprob")
    pq.write_table(table.set_column(index, table.schema.field(index), pa.array(logprobs, pa.list_(pa.float64()))),
                   part)
    assert pc.sum(pc.equal(table.column("id"), 1)).as_py() == 1

    page = tmp_path / "page.html"
    done = CliRunner().invoke(cli.app, ["report", str(other), "--against", str(scored_run), "--metric", ACC,
                                        "-o", str(page), "--json"])
    assert done.exit_code == 0, done.output
    change = json.loads(done.stdout)["against"]["acc"]
    expected = (1, 0) if was_right else (0, 1)
    assert (change["num_right_to_wrong"], change["num_wrong_to_right"]) == expected
    assert change["delta"] == pytest.approx((-1 if was_right else 1) / len(CONTEXTS))
    html = page.read_text()
    assert keyed_cells(html, "comparison-counts")["different"][-1] == "1"
    [(key, cells)] = keyed_cells(html, "flipped-acc").items()
    assert key == "1/0" and cells[3].startswith(f"continuation {wrong if was_right else label} of 3 is the most likely")
    assert cells[4].startswith("continuation ") and "log-probabilities: " in cells[4]

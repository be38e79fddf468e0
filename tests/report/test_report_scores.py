"""The report's scores on hand-made folders whose parts carry metric verdict columns (as a job's `metrics:`
section writes them): the page leads with them, `_SUCCESS`'s aggregates win over the parts', `--metric`
scores the rows post hoc as score_table scores the whole table, and `--against` lists exactly the rows
whose verdicts were planted to flip, with the deltas and McNemar's exact p-value (scipy's binomial test)."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy.stats import binomtest
from typer.testing import CliRunner

from batchgen.cli import main as cli
from batchgen.cli.report import format_scores
from batchgen.metrics import aggregate, score_table
from batchgen.metrics.spec import ExactMatch, RegexMatch
from batchgen.report import Report, ReportConfig, ReportError, build_report, render_report
from batchgen.report.compare import compare_runs
from batchgen.report.metric_scores import RunScores, ShownScore, parse_metric_option
from batchgen.report.run_stats import RunStats
from batchgen.report.source import RunFolder
from tests.pipeline.conftest import read_output
from tests.report.folders import row, write_run
from tests.report.html_cells import keyed_cells

ANSWER = (pa.field("answer", pa.string()),)
TOPIC = pa.field("topic", pa.string())
EM = ExactMatch(type="exact_match", reference_column="answer")
JUDGE = RegexMatch(type="regex_match", pattern="x")  # its verdicts are planted, not derived from the texts
NUM_IDS = 12
RIGHT_TO_WRONG = {("q-01", 0), ("q-07", 0)}  # em's planted flips
WRONG_TO_RIGHT = {("q-04", 1)}
JUDGE_TO_WRONG = 12  # judge: the first 12 rows go right -> wrong, one row wrong -> right


def mcnemar_reference(b: int, c: int) -> float:
    return binomtest(min(b, c), b + c, 0.5).pvalue


def scores_of(config: ReportConfig) -> list[ShownScore]:
    """The scores the page would lead with, without drawing its plots."""
    folder = RunFolder(config.out)
    stats = RunStats(folder, config)
    for part_index, batch in folder.iter_batches(stats.columns, config.batch_rows):
        stats.add(part_index, batch)
    return stats.figures().scores


def _category_cells(html: str) -> dict[str, list[str]]:
    """{category: its row's cell texts} of the page's table by --by."""
    body = html.split('id="category-table"')[1].split("</table>")[0]
    rows = [re.findall(r"<td[^>]*>([^<]*)</td>", tr) for tr in body.split("<tr>")[2:]]
    return {cells[0]: cells[1:] for cells in rows}


def _keys() -> list[tuple[str, int]]:
    return [(f"q-{i:02d}", s) for i in range(NUM_IDS) for s in (0, 1)]


def _rows(is_new: bool) -> list[dict]:
    """Every third row of the baseline is wrong; the new run flips exactly the planted rows."""
    rows = []
    for k, key in enumerate(_keys()):
        is_right = k % 3 != 0
        if is_new and key in RIGHT_TO_WRONG | WRONG_TO_RIGHT:
            is_right = not is_right
        reference = f"answer {key[0]}"
        completion = reference if is_right else f"{'new' if is_new else 'old'} wrong {key[0]}/{key[1]}"
        judge = k == NUM_IDS * 2 - 1 if is_new else k < JUDGE_TO_WRONG  # the last row: the one wrong -> right
        rows.append(row(key[0], completion, sample_index=key[1], answer=reference, metric_em=float(is_right),
                        metric_judge=float(judge)))
    return rows


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scored-runs")
    for name, is_new, per_part in (("new", True, 5), ("old", False, 7)):
        rows = _rows(is_new)
        if not is_new:
            rows = rows[::-1]  # another order of rows and parts
        write_run(str(tmp / name), rows, rows_per_part=per_part, id_type=pa.string(), keep=ANSWER,
                  metrics={"em": EM, "judge": JUDGE})
    return tmp / "new", tmp / "old"


def test_scores_lead_the_page_from_the_parts_or_success(tmp_path):
    verdicts = [1.0, 0.0, 1.0, 0.0, None, 0.0, 1.0, 0.0, 1.0, 0.0]  # a null verdict: not scored
    rows = [row(i, "a", answer="a", topic=f"t{i % 2}", metric_em=v) for i, v in enumerate(verdicts)]
    write_run(str(tmp_path / "parts"), rows, keep=(*ANSWER, TOPIC), metrics={"em": EM})
    assert pq.read_schema(tmp_path / "parts" / "part-00000.parquet").field("metric_em").metadata  # how it aggregates
    report = render_report(ReportConfig(out=str(tmp_path / "parts"), by="topic"))
    [shown] = report.scores
    scored = np.array([v for v in verdicts if v is not None])
    stderr = scored.std(ddof=1) / np.sqrt(scored.size)  # lm-eval's mean_stderr
    assert (shown.name, shown.type, shown.source, shown.is_from_success) == ("em", "exact_match", "job", False)
    assert shown.score.value == pytest.approx(scored.mean()) and shown.score.n == scored.size
    assert shown.score.stderr == pytest.approx(stderr)
    assert shown.interval == pytest.approx((scored.mean() - 1.96 * stderr, scored.mean() + 1.96 * stderr))
    html = report.html
    assert html.index('id="scores"') < html.index('id="summary"') < html.index('id="plots"')
    cells = keyed_cells(html, "scores-table")["em"]
    low, high = scored.mean() - 1.96 * stderr, scored.mean() + 1.96 * stderr
    assert cells[2:4] == [f"{scored.mean():.4f}", f"{low:.4f} to {high:.4f}"]
    assert cells[5] == str(scored.size)
    # By topic: t0 holds rows 0, 2, 4 (unscored), 6, 8 -> 4 of 4 right; t1 rows 1, 3, 5, 7, 9 -> none.
    assert '<th class="num">em</th>' in html
    assert {name: figures[-1] for name, figures in _category_cells(html).items()} == {"t0": "1.0000", "t1": "0.0000"}

    recorded = {"em": {"value": 0.25, "stderr": 0.125, "n": 6}}  # not the parts' mean: _SUCCESS wins
    write_run(str(tmp_path / "recorded"), rows, keep=ANSWER, metrics={"em": EM}, success_metrics=recorded)
    [shown] = scores_of(ReportConfig(out=str(tmp_path / "recorded")))
    assert (shown.score.value, shown.score.stderr, shown.score.n, shown.is_from_success) == (0.25, 0.125, 6, True)
    assert shown.interval == pytest.approx((0.25 - 1.96 * 0.125, 0.25 + 1.96 * 0.125))

    write_run(str(tmp_path / "none"), [row(1), row(2)])
    report = render_report(ReportConfig(out=str(tmp_path / "none")))
    assert report.scores == [] and "No metric: the job has no <code>metrics:</code> section" in report.html


def test_against_lists_exactly_the_planted_flips(two_runs):
    new, old = two_runs
    config = ReportConfig(out="", partition_bytes=256, num_listed_ids=5,
                          metrics={"has": parse_metric_option("has={type: contains, reference_column: answer}")[1]})
    c = compare_runs(RunFolder(str(new)), RunFolder(str(old)), config)
    assert c.num_partitions > 1
    by_name = {change.name: change for change in c.score_changes}
    assert set(by_name) == {"em", "judge", "has"}
    num_rows = NUM_IDS * 2
    for name in ("em", "has"):  # has: scored here from the texts, in both runs
        change = by_name[name]
        assert {(r.id, r.sample_index) for r in change.flipped if not r.is_now_right} == RIGHT_TO_WRONG
        assert {(r.id, r.sample_index) for r in change.flipped if r.is_now_right} == WRONG_TO_RIGHT
        assert (change.num_paired, change.num_right_to_wrong, change.num_wrong_to_right) == (num_rows, 2, 1)
        assert change.delta == pytest.approx(-1 / num_rows)
        assert change.p_value == pytest.approx(mcnemar_reference(2, 1)) and not change.is_beyond_noise
    flipped = {(r.id, r.sample_index): r for r in by_name["em"].flipped}
    assert flipped[("q-01", 0)].new_answer == "new wrong q-01/0" and flipped[("q-01", 0)].old_answer == "answer q-01"
    assert flipped[("q-04", 1)].new_answer == "answer q-04" and flipped[("q-04", 1)].old_answer == "old wrong q-04/1"

    judge = by_name["judge"]
    assert (judge.num_right_to_wrong, judge.num_wrong_to_right) == (JUDGE_TO_WRONG, 1)
    assert judge.p_value == pytest.approx(mcnemar_reference(JUDGE_TO_WRONG, 1)) and judge.is_beyond_noise
    keys = [(r.id, r.sample_index) for r in judge.flipped]
    assert keys == _keys()[:5]  # bounded: the 5 smallest of 13

    # What `batchgen report` prints without --json.
    lines = format_scores(Report("", c.new.scores, c.score_changes), str(old))
    compared = lines[lines.index(f"against {old}") + 1:]
    em = next(line for line in compared if line.split()[0] == "em")
    assert em.split()[1:4] == [f"{15 / 24:.4f}", "vs", f"{16 / 24:.4f}"] and f"change {-1 / 24:+.4f}" in em
    assert "right->wrong 2" in em and "wrong->right 1 of 24 paired" in em and em.endswith("p 1: within noise")
    assert next(line for line in compared if line.split()[0] == "judge").endswith("beyond noise")


def test_the_page_and_the_command_show_the_changes(two_runs, tmp_path):
    new, old = two_runs
    runner = CliRunner()
    page = tmp_path / "page.html"
    done = runner.invoke(cli.app, ["report", str(new), "--against", str(old), "-o", str(page), "--json"])
    assert done.exit_code == 0, done.output
    printed = json.loads(done.stdout)
    assert printed["report"] == str(page)
    em = printed["against"]["em"]
    assert em["this_run"]["value"] == pytest.approx(15 / 24) and em["baseline"]["value"] == pytest.approx(16 / 24)
    assert (em["num_right_to_wrong"], em["num_wrong_to_right"], em["is_beyond_noise"]) == (2, 1, False)
    assert printed["against"]["judge"]["mcnemar_p"] == pytest.approx(mcnemar_reference(JUDGE_TO_WRONG, 1))
    assert printed["scores"]["em"]["n"] == 24 and printed["scores"]["em"]["source"] == "job"

    html = page.read_text()
    changes = keyed_cells(html, "score-changes")
    assert changes["em"][1:4] == [f"{15 / 24:.4f}", f"{16 / 24:.4f}", f"{-1 / 24:+.4f}"]
    assert changes["em"][-2:] == ["1", "within noise"] and changes["judge"][-1] == "beyond noise"
    flipped = keyed_cells(html, "flipped-em")
    assert set(flipped) == {f"{i}/{s}" for i, s in RIGHT_TO_WRONG | WRONG_TO_RIGHT}
    assert flipped["q-07/0"][2:] == ["right → wrong", "new wrong q-07/0", "answer q-07"]



def test_a_post_hoc_metric_equals_score_table_on_the_whole_table(tmp_path):
    references = ["Paris", "4", "blue", None, "The Answer: 42"]
    completions = ["The capital is PARIS.", "4", None, "x", "the answer: 42!"]
    rows = [row(i, completions[i % 5], answer=references[(i + i % 2) % 5],
                finish_reason="error" if completions[i % 5] is None else "stop") for i in range(23)]
    write_run(str(tmp_path / "run"), rows, rows_per_part=6, keep=ANSWER)
    whole = read_output(tmp_path / "run")
    specs = dict(parse_metric_option(text) for text in (
        ("em={type: exact_match, reference_column: answer, ignore_case: true, ignore_punctuation: true, "
         "regex: '(?i)answer: (\\d+)|(paris)', group_select: -1}"),
        "has={type: contains, reference_column: answer, ignore_case: true}",
        "num={type: numeric_match, reference_column: answer}"))
    scores = RunScores(RunFolder(str(tmp_path / "run")), ReportConfig(out="", metrics=specs))
    for _, batch in RunFolder(str(tmp_path / "run")).iter_batches(scores.columns, batch_rows=4):
        scores.add(batch)
    for name, spec in specs.items():
        expected = score_table(name, spec, whole)
        assert scores.verdicts[name].tolist() == expected.tolist(), name
        assert 0 < expected.sum() < len(expected), name  # the metric tells rows apart
        [shown] = [s for s in scores.results() if s.name == name]
        assert shown.score == aggregate({"type": spec.type}, expected) and shown.source == "--metric"


def test_reference_is_the_exact_match_metric_with_unreferenced_rows_unscored(tmp_path):
    rows = [row(1, " Paris\n", answer="Paris"), row(2, "4", answer="5"), row(3, "x", answer=None),
            row(4, None, finish_reason="error", answer="y")]
    write_run(str(tmp_path / "run"), rows, keep=ANSWER)
    [shown] = scores_of(ReportConfig(out=str(tmp_path / "run"), reference="answer"))
    assert (shown.name, shown.source, shown.score.value, shown.score.n) == ("exact_match", "--reference", 1 / 3, 3)
    spec = parse_metric_option("exact_match={type: exact_match, reference_column: answer}")[1]
    [same] = scores_of(ReportConfig(out=str(tmp_path / "run"), metrics={"exact_match": spec}))
    assert (same.score.value, same.score.n) == (1 / 4, 4)  # --metric scores every row, as a job would


@pytest.mark.parametrize("text, message", [
    ("em", "write NAME=SPEC"),
    ("2em={type: contains, reference_column: answer}", "metric name '2em'"),
    ("em=[1, 2]", "--metric em: the spec is not a YAML mapping"),
    ("em={type: exact_match, reference_column: answer", "--metric em: while parsing"),
    ("em={type: fuzzy_match}", "--metric em: .*does not match any of the expected tags"),
    ("em={type: exact_match}", "--metric em: exact_match.reference_column: Field required"),
    ("em={type: exact_match, reference_column: answer, ignore_kase: true}", "exact_match.ignore_kase: Extra"),
    ("em={type: regex_match, pattern: '('}", "--metric em: regex_match.pattern: .*not a regular expression"),
])
def test_bad_metric_specs_are_named(text, message):
    with pytest.raises(ReportError, match=message):
        parse_metric_option(text)


def test_unknown_columns_and_wrong_tasks_are_named(tmp_path):
    write_run(str(tmp_path / "run"), [row(1, answer="a"), row(2, answer="b")], keep=ANSWER)
    runner = CliRunner()
    bad = runner.invoke(cli.app, ["report", str(tmp_path / "run"), "--metric",
                                  "em={type: exact_match, reference_column: solution}", "-o", str(tmp_path / "p.html")])
    assert bad.exit_code == 2
    assert "batchgen report: --metric em: " in bad.output and "has no column 'solution'" in bad.output
    with pytest.raises(ReportError, match="--metric acc: choice_accuracy scores a loglikelihood run's continuations"):
        build_report(ReportConfig(out=str(tmp_path / "run"),
                                  metrics=dict([parse_metric_option("acc={type: choice_accuracy, label_column: answer}")])))
    with pytest.raises(ReportError, match="--reference solution: .* has no column 'solution'"):
        build_report(ReportConfig(out=str(tmp_path / "run"), reference="solution"))
    twice = runner.invoke(cli.app, ["report", str(tmp_path / "run"), "--metric", "m={type: regex_match, pattern: a}",
                                    "--metric", "m={type: regex_match, pattern: b}", "-o", str(tmp_path / "p.html")])
    assert twice.exit_code == 2 and "--metric m is given twice" in twice.output
    assert not (tmp_path / "p.html").exists()


def test_pass_at_k_columns_aggregate_by_id(tmp_path):
    """The unbiased pass@k of each id's samples (1 - C(n - c, k) / C(n, k), the HumanEval paper's), averaged
    over ids, from rows spread over parts; n counts ids. Needs batchgen.metrics.pass_at_k (the code metric)."""
    from math import comb

    from batchgen.metrics.spec import PassAtK

    spec = PassAtK(type="pass_at_k", test_column="tests", k=2)
    passed = {"a": [1, 0, 0, 0], "b": [0, 0, 0, 0], "c": [1, 1, 1, 1]}
    rows = [row(key, "code", sample_index=s, tests="assert True", metric_code=float(v))
            for key, verdicts in passed.items() for s, v in enumerate(verdicts)]
    write_run(str(tmp_path / "run"), rows, rows_per_part=5, id_type=pa.string(),
              keep=(pa.field("tests", pa.string()),), metrics={"code": spec})
    [shown] = scores_of(ReportConfig(out=str(tmp_path / "run")))
    per_id = [1 - comb(4 - sum(v), 2) / comb(4, 2) for v in passed.values()]
    assert (shown.type, shown.k, shown.score.n) == ("pass_at_k", 2, 3)
    assert shown.score.value == pytest.approx(np.mean(per_id))
    assert shown.score.stderr == pytest.approx(np.std(per_id, ddof=1) / np.sqrt(3))

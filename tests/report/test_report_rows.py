"""The report on hand-made folders: markup in rows stays text, the partitioned join agrees with itself and
with the rows as written, token positions, exact match, refusals, object stores, folder problems."""

from __future__ import annotations

import random

import fsspec
import numpy as np
import pyarrow as pa
import pytest

from batchgen.report import ReportConfig, ReportError, build_report, token_diff, write_report
from batchgen.report.compare import compare_runs
from batchgen.report.source import RunFolder
from tests.report.conftest import column_texts, open_page
from tests.report.folders import row, write_run

CATEGORY = (pa.field("category", pa.string()),)
ANSWER = (pa.field("answer", pa.string()),)


@pytest.mark.browser
def test_markup_in_rows_reaches_the_page_as_text(tmp_path, browser):
    script = "<script>window.pwned = 1</script>"
    image = '<img src="x" onerror="window.pwned = 2">'
    bold = "<b>bold</b>"
    rows = [row(1, script, category=bold, e2e_s=9.0), row(2, "plain", category="$x^2$"),
            row(3, None, [], finish_reason="error", error=image, category=bold, e2e_s=None)]
    write_run(str(tmp_path / "new"), rows, keep=CATEGORY)
    write_run(str(tmp_path / "old"), [row(1, "other text"), row(2, "plain"), row(3, None, [], finish_reason="error")],
              keep=CATEGORY)
    path = write_report(ReportConfig(out=str(tmp_path / "new"), against=str(tmp_path / "old"), by="category",
                                     output=str(tmp_path / "page.html")))
    page = open_page(browser, path)
    assert page.console_errors() == []  # an <img src="x"> made markup would fail to load
    assert page.evaluate("window.pwned") is None
    assert page.evaluate("document.scripts.length") == 0
    assert page.evaluate("document.querySelectorAll('#summary b, table b, .diff b, img').length") == 0
    assert script in column_texts(page, "#slowest-rows td.text")
    assert column_texts(page, "#failed-rows td.text") == [image]
    assert page.evaluate("document.querySelector('.diff .text').textContent") == script
    labels = page.evaluate("document.querySelector('#plot-categories svg').textContent")
    assert bold in labels and "$x^2$" in labels  # matplotlib escaped it; math parsing is off
    assert bold in column_texts(page, "#category-table td:first-child")


def _lists(rng: random.Random, n: int) -> list[list[int] | None]:
    return [None if rng.random() < 0.05 else [rng.randrange(5) for _ in range(rng.randrange(6))] for _ in range(n)]


def test_first_difference_matches_a_plain_loop(monkeypatch):
    monkeypatch.setattr(token_diff, "_CHUNK_ROWS", 7)  # several chunks
    rng = random.Random(0)
    a, b = _lists(rng, 200), _lists(rng, 200)
    b[:50] = a[:50]  # some equal rows
    b[50:60] = [x + [1] if x else [1] for x in a[50:60]]  # one a prefix of the other
    expected = []
    for x, y in zip(a, b):
        x, y = x or [], y or []
        expected.append(-1 if x == y else next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
    got = token_diff.first_difference(pa.array(a, pa.list_(pa.int32())), pa.array(b, pa.list_(pa.int32())))
    assert got.tolist() == expected
    sliced = token_diff.first_difference(pa.array(a, pa.list_(pa.int32())).slice(30, 100),
                                         pa.array(b, pa.list_(pa.int32())).slice(30, 100))
    assert sliced.tolist() == expected[30:130]


def _two_runs(tmp_path, num_ids: int = 120):
    """Two runs of string ids, 2 samples each: which keys differ, which are missing where, is known."""
    rng = random.Random(1)
    new_rows, old_rows = [], []
    different, only_new, only_old = set(), set(), set()
    for i in range(num_ids):
        key = f"q-{i:03d}"
        for s in (0, 1):
            text = f"answer {i} {s}"
            fate = rng.random()
            if fate < 0.1:
                only_new.add((key, s))
                new_rows.append(row(key, text, sample_index=s))
            elif fate < 0.15:
                only_old.add((key, s))
                old_rows.append(row(key, text, sample_index=s))
            else:
                changed = text + " more" if fate < 0.35 else text
                if changed != text:
                    different.add((key, s))
                new_rows.append(row(key, changed, sample_index=s, category=f"c{i % 3}"))
                old_rows.append(row(key, text, sample_index=s, category=f"c{i % 3}"))
    rng.shuffle(old_rows)  # another order of rows and parts
    write_run(str(tmp_path / "new"), new_rows, rows_per_part=17, id_type=pa.string(), keep=CATEGORY)
    write_run(str(tmp_path / "old"), old_rows, rows_per_part=23, id_type=pa.string(), keep=CATEGORY)
    return different, only_new, only_old


def test_partitioned_join_finds_the_keys_as_written(tmp_path):
    different, only_new, only_old = _two_runs(tmp_path)
    runs = RunFolder(str(tmp_path / "new")), RunFolder(str(tmp_path / "old"))
    whole = compare_runs(*runs, ReportConfig(out="", by="category", partition_bytes=1 << 30, num_listed_ids=1000))
    split = compare_runs(*runs, ReportConfig(out="", by="category", partition_bytes=64, num_listed_ids=1000))
    assert whole.num_partitions == 1 and split.num_partitions > 10
    for c in (whole, split):
        assert {(r.id, r.sample_index) for r in c.different} == different and c.num_different == len(different)
        assert set(c.only_new) == only_new and set(c.only_old) == only_old
        assert c.num_identical == runs[0].num_rows - len(only_new) - len(different)
        assert all(r.first_token == len(f"answer {r.id[2:].lstrip('0') or '0'} {r.sample_index}")
                   for r in c.different)  # " more" appended: the new text's tokens part where the old ends
    assert whole.categories == split.categories
    assert sum(r.num_different for r in whole.categories) == len(different)
    assert whole.first_token_counts.tolist() == split.first_token_counts.tolist()

    bounded = compare_runs(*runs, ReportConfig(out="", partition_bytes=64, num_listed_ids=5, num_inline_diffs=2))
    assert [(r.id, r.sample_index) for r in bounded.different] == sorted(different)[:5]
    assert bounded.only_new == sorted(only_new)[:5] and bounded.num_different == len(different)
    assert [(d.id, d.sample_index) for d in bounded.diffs] == sorted(different)[:2]


def test_exact_match_against_a_reference_column(tmp_path):
    refs = {1: "Paris", 2: "4", 3: "blue", 4: None, 5: "x"}
    old = {1: "Paris", 2: "5", 3: "blue", 4: "anything", 5: "x"}
    new = {1: " Paris\n", 2: "4", 3: "red", 4: "anything", 5: None}  # 5: an error row
    write_run(str(tmp_path / "old"), [row(i, t, answer=refs[i]) for i, t in old.items()], keep=ANSWER)
    write_run(str(tmp_path / "new"), [row(i, t, answer=refs[i], finish_reason="error" if t is None else "stop")
                                      for i, t in new.items()], keep=ANSWER)
    c = compare_runs(RunFolder(str(tmp_path / "new")), RunFolder(str(tmp_path / "old")),
                     ReportConfig(out="", reference="answer"))
    [new_score], [old_score] = c.new.scores, c.old.scores  # --reference: the metric exact_match
    assert (new_score.name, new_score.source, new_score.type) == ("exact_match", "--reference", "exact_match")
    assert (new_score.score.value, old_score.score.value) == (2 / 4, 3 / 4)  # id 4 has no reference: not scored
    assert new_score.score.n == old_score.score.n == 4
    [change] = c.score_changes
    assert (change.num_paired, change.num_wrong_to_right, change.num_right_to_wrong) == (4, 1, 2)
    assert {(r.id, r.is_now_right) for r in change.flipped} == {(2, True), (3, False), (5, False)}


def test_runs_of_different_prompts_are_refused(tmp_path):
    write_run(str(tmp_path / "ints"), [row(1), row(2)])
    write_run(str(tmp_path / "strings"), [row("1"), row("2")], id_type=pa.string())
    write_run(str(tmp_path / "others"), [row(7), row(8)])
    write_run(str(tmp_path / "longer"), [row(1), row(2, prompt_tokens=99)])
    write_run(str(tmp_path / "longer-other-model"), [row(1), row(2, prompt_tokens=99)], model="another-model")
    write_run(str(tmp_path / "repeated"), [row(1), row(1)])

    def compare(a: str, b: str):
        return compare_runs(RunFolder(str(tmp_path / a)), RunFolder(str(tmp_path / b)), ReportConfig(out=""))

    with pytest.raises(ReportError, match="ids of .*ints are int64 and those of .*strings are string"):
        compare("ints", "strings")
    with pytest.raises(ReportError, match="no \\(id, sample_index\\) of .*others is in .*ints"):
        compare("others", "ints")
    with pytest.raises(ReportError, match="same model .*\\(id 2: 99 prompt tokens vs 10\\)"):
        compare("longer", "ints")
    assert compare("longer-other-model", "ints").num_identical == 2  # another tokenizer may count otherwise
    with pytest.raises(ReportError, match="repeated \\(id, sample_index\\)"):
        compare("repeated", "ints")


def test_object_store_folders_and_page(tmp_path):
    write_run("memory://report-test/new", [row(i, f"text {i}") for i in range(10)], rows_per_part=3)
    write_run("memory://report-test/old", [row(i, f"text {i % 7}") for i in range(10)], rows_per_part=5)
    written = write_report(ReportConfig(out="memory://report-test/new", against="memory://report-test/old",
                                        output="memory://report-test/pages/page.html"))
    html = fsspec.filesystem("memory").cat_file(written).decode()
    assert 'data-key="different"><th>different rows</th><td>3</td>' in html
    assert "memory://report-test/old" in html


def test_folder_problems_are_named(tmp_path):
    with pytest.raises(ReportError, match="no such folder"):
        build_report(ReportConfig(out=str(tmp_path / "nowhere")))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    with pytest.raises(ReportError, match="no part-\\*.parquet files and no _SUCCESS"):
        build_report(ReportConfig(out=str(tmp_path / "other")))
    write_run(str(tmp_path / "run"), [row(1), row(2)])
    with pytest.raises(ReportError, match="--by topic: .* has no column 'topic'; its columns are: id, "):
        build_report(ReportConfig(out=str(tmp_path / "run"), by="topic"))
    (tmp_path / "run" / "part-00000.parquet").unlink()
    assert "_SUCCESS says num_rows 2, the part files hold 0" in build_report(ReportConfig(out=str(tmp_path / "run")))
    write_run(str(tmp_path / "unfinished"), [row(1)], with_success=False)
    assert "has no _SUCCESS: the run is not finished" in build_report(ReportConfig(out=str(tmp_path / "unfinished")))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "part-00000.parquet").write_bytes(b"not parquet")
    with pytest.raises(ReportError, match="part-00000.parquet is not a readable Parquet file"):
        build_report(ReportConfig(out=str(tmp_path / "broken")))


def test_latency_figures_ignore_missing_values():
    from batchgen.report.run_stats import latency_figures

    values = np.array([np.nan, 1.0, 2.0, 3.0, np.nan], np.float32)
    figures = latency_figures(values)
    assert (figures.p50, figures.count, figures.mean) == (2.0, 3, 2.0)
    assert latency_figures(np.array([np.nan], np.float32)).p50 is None


def test_side_by_side_segments_rebuild_both_texts():
    from batchgen.report.text_diff import diff_texts

    new, old = diff_texts("The cat sat on the big mat.\nDone", "The dog sat on a small mat!\nDone")
    assert "".join(s.text for s in new) == "The cat sat on the big mat.\nDone"
    assert "".join(s.text for s in old) == "The dog sat on a small mat!\nDone"
    assert [s.text for s in new if s.is_changed] == ["cat", "the big", "."]
    assert [s.text for s in old if s.is_changed] == ["dog", "a small", "!"]

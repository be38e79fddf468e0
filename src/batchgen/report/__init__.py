"""batchgen.report: `batchgen report`, one self-contained HTML page about a finished run.

A run's output folder (`_SUCCESS` and its `part-*.parquet` files, local or on an object store) is
read part by part (source.py) into bounded figures (run_stats.py); with a second folder the rows of
both are joined by (id, sample_index) through hash partitions on local disk (join.py) and compared
(compare.py, token_diff.py, text_diff.py). The page leads with the scores: the run's metric columns and
the metrics asked of the report (metric_scores.py), and with a second run their paired changes
(score_changes.py). A select stage's folder adds its counts and histograms (select_stage.py); a
multi-stage job's output.path gets a page of its stages from their records (stages_page.py). plots.py draws the figures as inline SVG (matplotlib), page.py renders the page
(jinja2, autoescaped: row text is shown as text, never as markup). Depends on batchgen.pipeline (the
output folder's names and storage) and batchgen.metrics (the verdicts); nothing imports it except the
`batchgen` command line, inside its `report` command and after `batchgen run --report`.
"""

from batchgen.report.config import ReportConfig, ReportError
from batchgen.report.page import Report, build_report, publish_report, render_report, write_report

__all__ = ["Report", "ReportConfig", "ReportError", "build_report", "publish_report", "render_report", "write_report"]

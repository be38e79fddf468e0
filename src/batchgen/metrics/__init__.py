"""Eval metrics: per-row verdicts and their aggregates, shared by jobs (`metrics:`), `batchgen report`
and the server-free scoring of an output folder. Imports only numpy, pyarrow and pydantic."""

from batchgen.metrics.aggregate import MetricScore, aggregate, metric_field, metric_fields_of
from batchgen.metrics.row_scores import MetricError, score_table
from batchgen.metrics.spec import METRIC_TYPES, MetricSpec, check_metric_name, metric_column

__all__ = ["METRIC_TYPES", "MetricError", "MetricScore", "MetricSpec", "aggregate", "check_metric_name",
           "metric_column", "metric_field", "metric_fields_of", "score_table"]

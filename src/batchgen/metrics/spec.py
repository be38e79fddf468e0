"""The job file's `metrics:` section: one named metric per key, its kind chosen by `type`.

    metrics:
      acc: {type: choice_accuracy, label_column: label}
      em: {type: exact_match, reference_column: answer, regex: "#### (\\-?[0-9.,]+)", ignore_case: true}

Each metric is a function of one output row (its completion or its continuations' log-probabilities,
and the input columns it names), giving a per-row verdict (`metric_<name>`: 1.0 right, 0.0 wrong) and an
aggregate (`_SUCCESS`'s `metrics.<name>`: value, stderr, n). Definitions follow lm-evaluation-harness
where it has one (see each class)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

METRIC_COLUMN_PREFIX = "metric_"
METRIC_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class _Metric(BaseModel):
    """What every metric has: a threshold a run can fail on."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    min: float | None = None
    """The run fails (exit 3, after writing _SUCCESS) when the aggregate is below this; null: never."""

    @property
    def input_columns(self) -> list[str]:
        """The input columns the metric reads (kept in the output so that the report can read them too)."""
        return []

    @property
    def is_choice(self) -> bool:
        """Scores a loglikelihood job's continuations rather than a completion."""
        return False


class _Normalised(_Metric):
    """lm-eval's `exact_match` options (HF evaluate's), applied to both sides, in its order: regexes
    removed, then lower case, punctuation, digits."""

    strip: bool = True
    """Surrounding whitespace removed from both sides first (lm-eval's regex filter strips its match;
    without a filter lm-eval tasks add a `strip` filter or compare as is)."""
    regexes_to_ignore: list[str] = Field(default_factory=list)
    """Regular expressions whose matches are deleted from both sides before comparing (GSM8K's lm-eval
    task deletes commas, dollar signs and a final full stop)."""
    ignore_case: bool = False
    """Compare lower-cased."""
    ignore_punctuation: bool = False
    """Delete ASCII punctuation (string.punctuation) from both sides."""
    ignore_numbers: bool = False
    """Delete ASCII digits from both sides."""

    @field_validator("regexes_to_ignore")
    @classmethod
    def _compiles(cls, value: list[str]) -> list[str]:
        for pattern in value:
            _check_regex(pattern)
        return value


class _Extracting(_Normalised):
    """lm-eval's `regex` filter before comparing: the answer is taken out of the completion."""

    regex: str | None = None
    """Extract the answer: re.findall over the completion, then the match at `group_select` (a match with
    several groups gives its first non-empty group), stripped; no match gives `fallback`. null: the whole
    completion."""
    group_select: int = 0
    """Which match: 0 the first, -1 the last (lm-eval's flexible-extract)."""
    fallback: str = "[invalid]"
    """The answer when the regex finds nothing (lm-eval's default; counts as wrong unless a reference
    equals it)."""

    @field_validator("regex")
    @classmethod
    def _regex_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            _check_regex(value)
        return value


class ExactMatch(_Extracting):
    """1 when the (extracted, normalised) completion equals the normalised reference: lm-eval's
    `exact_match` after its filters."""

    type: Literal["exact_match"]
    reference_column: str
    """The input column holding the expected answer (text, or a number written as text)."""

    @property
    def input_columns(self) -> list[str]:
        return [self.reference_column]


class Contains(_Extracting):
    """1 when the normalised reference occurs in the (extracted, normalised) completion."""

    type: Literal["contains"]
    reference_column: str
    """The input column holding the text that must occur."""

    @property
    def input_columns(self) -> list[str]:
        return [self.reference_column]


class RegexMatch(_Metric):
    """1 when `pattern` is found in the completion (re.search)."""

    type: Literal["regex_match"]
    pattern: str
    """The regular expression (Python syntax)."""
    ignore_case: bool = False
    """Match case-insensitively."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        _check_regex(value)
        return value


class NumericMatch(_Metric):
    """1 when the last number in the completion equals the reference's number within the tolerance
    (GSM8K scorers' "flexible" answer: thousands separators and a leading $ ignored)."""

    type: Literal["numeric_match"]
    reference_column: str
    """The input column holding the expected number (a number, or text whose last number is taken, as
    GSM8K's "#### 72")."""
    abs_tol: float = Field(default=1e-6, ge=0)
    """Absolute tolerance."""
    rel_tol: float = Field(default=0.0, ge=0)
    """Relative tolerance (math.isclose)."""

    @property
    def input_columns(self) -> list[str]:
        return [self.reference_column]


class ChoiceAccuracy(_Metric):
    """task: loglikelihood. 1 when the continuation with the highest log-probability is the label:
    lm-eval's `acc` for multiple_choice (`choice_accuracy`), or its `acc_norm` (`choice_accuracy_norm`:
    log-probabilities divided by each choice's length in characters; `length_unit: bytes` gives
    lm-eval's `acc_bytes`). Ties go to the first continuation (numpy's argmax, as lm-eval).

    lm-eval scores `target_delimiter + choice` after the context but measures (and looks a text label up
    in) the choice alone: a continuation written as it is scored (" Paris") counts as the choice "Paris"."""

    type: Literal["choice_accuracy", "choice_accuracy_norm"]
    label_column: str
    """The input column naming the right continuation: its index (0-based integer) or its text."""
    length_unit: Literal["characters", "bytes"] = "characters"
    """choice_accuracy_norm: what a choice's length counts (lm-eval's acc_norm: characters)."""
    target_delimiter: str = " "
    """lm-eval's name: what separates the context from a choice. A continuation that starts with it is
    the choice without it, for its length and for a text label; "" for choices that carry their own
    leading space (tasks that set lm-eval's target_delimiter: "")."""

    @property
    def is_choice(self) -> bool:
        return True

    @property
    def is_normalised(self) -> bool:
        return self.type == "choice_accuracy_norm"

    @property
    def input_columns(self) -> list[str]:
        return [self.label_column]


class PassAtK(_Metric):
    """Code: each sample's program (the row's prompt when `prompt_column` is set, the completion, the
    row's tests, then `check(<entry point>)`, as HumanEval's harness builds it) run in a limited
    subprocess; the row's verdict is 1 when it exits cleanly. The aggregate is the unbiased pass@k of the
    HumanEval paper over each id's n samples, averaged over ids."""

    type: Literal["pass_at_k"]
    test_column: str
    """The input column holding the test code (HumanEval's `test`: defines check(candidate))."""
    entry_point_column: str | None = None
    """The input column naming the function under test: `check(<it>)` is appended; null: the tests
    run as written."""
    prompt_column: str | None = None
    """An input column whose text goes before the completion (HumanEval's prompt, when the completion
    continues it); null: the completion alone."""
    k: int = Field(default=1, ge=1)
    """pass@k's k (at most the job's sampling.n)."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock limit per program."""
    memory_mb: int = Field(default=1024, ge=16)
    """Address-space limit per program (MiB)."""

    @property
    def input_columns(self) -> list[str]:
        return [c for c in (self.test_column, self.entry_point_column, self.prompt_column) if c is not None]


MetricSpec = Annotated[ExactMatch | Contains | RegexMatch | NumericMatch | ChoiceAccuracy | PassAtK,
                       Field(discriminator="type")]
METRIC_TYPES = ("exact_match", "contains", "regex_match", "numeric_match", "choice_accuracy",
                "choice_accuracy_norm", "pass_at_k")


def metric_column(name: str) -> str:
    """The output column holding a metric's per-row verdicts."""
    return METRIC_COLUMN_PREFIX + name


def check_metric_name(name: str) -> str:
    if not METRIC_NAME.match(name):
        raise ValueError(f"metric name {name!r}: use letters, digits and _, starting with a letter "
                         f"(it names the column {metric_column(name)!r})")
    return name


def _check_regex(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{pattern!r} is not a regular expression ({exc})") from None

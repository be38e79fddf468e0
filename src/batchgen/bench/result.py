"""What one timed pass over a workload produced, and how two passes' greedy tokens agree."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.text.token_prefix import num_shared_prefix


@dataclass
class TimedRun:
    """One timed pass over a workload: token counts, wall seconds and each request's output tokens."""

    name: str
    num_prompt_tokens: int
    num_completion_tokens: int
    seconds: float
    output_token_ids: dict[str, list[int]] = field(repr=False)
    details: dict = field(default_factory=dict)  # side-specific figures (engine stats, peer batch size, ...)

    @property
    def completion_tokens_per_s(self) -> float:
        return self.num_completion_tokens / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {"name": self.name, "prompt_tokens": self.num_prompt_tokens,
                "completion_tokens": self.num_completion_tokens, "seconds": self.seconds,
                "completion_tokens_per_s": self.completion_tokens_per_s, **self.details}


@dataclass(frozen=True)
class Agreement:
    num_requests: int
    num_exact: int  # requests whose whole output is identical
    mean_prefix_len: float  # tokens before the first difference, averaged over requests
    mean_output_len: float

    def as_dict(self) -> dict:
        return {"num_requests": self.num_requests, "num_exact": self.num_exact,
                "mean_prefix_len": self.mean_prefix_len, "mean_output_len": self.mean_output_len}


def compare_outputs(ours: TimedRun, theirs: TimedRun) -> Agreement:
    """Per request id of `ours`: is the output identical, and how long is the common prefix."""
    ids = list(ours.output_token_ids)
    missing = [i for i in ids if i not in theirs.output_token_ids]
    if missing:
        raise ValueError(f"{theirs.name} has no output for {len(missing)} requests, e.g. {missing[0]!r}")
    prefixes = [num_shared_prefix(ours.output_token_ids[i], theirs.output_token_ids[i]) for i in ids]
    num_exact = sum(ours.output_token_ids[i] == theirs.output_token_ids[i] for i in ids)
    mean_len = sum(len(ours.output_token_ids[i]) for i in ids) / len(ids)
    return Agreement(len(ids), num_exact, sum(prefixes) / len(ids), mean_len)

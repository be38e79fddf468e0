"""Host time per engine step, split the way `batchgen bench --workload overhead` reports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimings:
    """Seconds summed over steps: schedule (Scheduler.schedule), prepare (pack and send the inputs,
    build the attention metadata), forward (model, sampler and the wait for the read-back: device
    work on a GPU) and process (unpack the read-back, append tokens, stop checks, outputs)."""

    num_steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    process: float = 0.0

    def reset(self) -> None:
        self.num_steps = 0
        self.schedule = self.prepare = self.forward = self.process = 0.0

    def add(self, *, schedule: float = 0.0, prepare: float = 0.0, forward: float = 0.0,
            process: float = 0.0) -> None:
        self.schedule += schedule
        self.prepare += prepare
        self.forward += forward
        self.process += process

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each part, and `host` = schedule + prepare + process."""
        n = max(self.num_steps, 1)
        parts = {name: 1e3 * getattr(self, name) / n for name in ("schedule", "prepare", "forward", "process")}
        parts["host"] = parts["schedule"] + parts["prepare"] + parts["process"]
        return parts

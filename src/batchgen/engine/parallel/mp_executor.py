"""Rank 0's side of tensor parallelism: the worker processes, the step broadcast, the watch on the workers.

`MultiprocExecutor` (engine/runner/executor.py's interface) starts one worker process per rank 1..N-1 with
multiprocessing's spawn (worker.py), hosts the group's TCPStore on the loopback address, and holds
rank 0's shard in this process: the engine schedules and samples here, as before. Each step the
runner packs every input into one buffer (step_inputs.py); before its forward it calls `send_step`,
which writes a small header to each worker's pipe (the step's sizes and host-side lengths) and
broadcasts the start of that buffer, the model's sections, ONCE to every worker. The ranks then run
the same forward, with one all-reduce after o_proj and one after down_proj per layer, and the logits
come back to rank 0 (engine/models/layers/decoder.py and causal_lm.py).

Faults: a watcher thread waits on the workers' process sentinels and logs a death at once; a
collective that fails (a peer's connection closed, or the group's timeout) or a pipe that broke ends
the step with WorkerDiedError naming the rank, its pid and how it ended, and the engine stays failed
(every later call raises the same). Workers stop when rank 0 says so, when this process is gone, or
when their own collective fails; the rest are terminated on shutdown, on garbage collection and at
exit.

Spawn starts each worker as a fresh interpreter that imports the caller's main module (as every
multiprocessing spawn does): a script that builds an engine with tensor_parallel_size > 1 keeps
its top level under `if __name__ == "__main__":`; one that does not is refused before any worker
starts, with the line to move (spawn_guard.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.kv.capacity import kv_bytes_per_token
from batchgen.engine.kv.gpu_memory import GpuMemoryPlan, plan_gpu_kv_cache
from batchgen.engine.loader.model_loader import LoadedModel, load_model, read_model_config
from batchgen.engine.loader.source import resolve_model
from batchgen.engine.parallel import TensorParallel, TensorParallelGroup
from batchgen.engine.parallel.group import STORE_TIMEOUT
from batchgen.engine.parallel.layout import all_layouts
from batchgen.engine.parallel.spawn_guard import check_spawn_safe
from batchgen.engine.parallel.worker import (
    PROFILE,
    SHUTDOWN,
    START,
    STEP,
    STEP_HEADER_INTS,
    WorkerSpec,
    rank_report,
    run_worker,
)
from batchgen.engine.runner.decode_graphs import decode_graph_profiler
from batchgen.engine.runner.model_runner import ModelRunner, StepResult
from batchgen.engine.runner.step_inputs import StepInputs, model_section_sizes

log = logging.getLogger("batchgen.engine")

_POLL_S = 0.2  # how often a wait on the workers' pipes looks at their processes
_DEATH_GRACE_S = 2.0  # after a failed collective, how long to wait for the peer's exit to show
_JOIN_S = 5.0  # shutdown: how long a worker gets to leave by itself


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank failed: the engine cannot run another step."""


def _exit_description(process: multiprocessing.Process) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class MultiprocExecutor:
    """Rank 0 of `config.tensor_parallel_size` ranks: this process and its worker processes."""

    def __init__(self, config: EngineConfig):
        check_spawn_safe()  # before anything starts: spawn would run an unguarded script again per worker
        self.config = config
        self.world_size = world_size = config.tensor_parallel_size
        device = config.torch_device
        self.model_cfg = read_model_config(resolve_model(config.model, config.revision))
        self.layouts = all_layouts(self.model_cfg, world_size)  # refuses a model that cannot split
        devices = _rank_devices(device, world_size)
        num_threads = config.num_threads
        if device.type == "cpu" and num_threads is None:  # the ranks share the cores
            num_threads = max(1, torch.get_num_threads() // world_size)
            torch.set_num_threads(num_threads)
        self.runner: ModelRunner | None = None
        self.failure: WorkerDiedError | None = None
        self.reports: list[dict] = []
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self.conns = []
        self._inbox: list[deque] = []
        stopping = threading.Event()  # set once the workers are asked to leave: their exits are expected
        # Registered before the first start: the lists fill as the workers start.
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.conns, stopping)
        for rank in range(1, world_size):
            spec = WorkerSpec(config.replace(device=str(devices[rank])), rank, world_size, self.store.port,
                              os.getpid(), num_threads, logging.getLogger("batchgen").getEffectiveLevel())
            ours, theirs = context.Pipe(duplex=True)
            process = context.Process(target=run_worker, args=(spec, theirs), daemon=True,
                                      name=f"batchgen-tp-rank{rank}")
            process.start()
            theirs.close()
            self.processes.append(process)
            self.conns.append(ours)
            self._inbox.append(deque())
        threading.Thread(target=_watch, args=(list(self.processes), stopping), name="batchgen-tp-watch",
                         daemon=True).start()
        log.info("tensor parallelism: %d ranks on %s; worker pids %s", world_size,
                 ", ".join(str(d) for d in devices), ", ".join(str(p.pid) for p in self.processes))
        self._said_hello = [False] * len(self.processes)  # a worker that dies before it did never ran our code
        if device.type == "cuda":
            torch.cuda.set_device(devices[0])
        # Joined on a thread: rank 0 loads its shard while the workers start (load_model waits for them).
        group = TensorParallelGroup(self.store, 0, world_size, devices[0], check_peers=self._check_alive,
                                    in_background=True)
        self.parallel = TensorParallel(self.layouts[0], group, check_peers=self.check_workers)

    # ---- the engine's calls (engine/runner/executor.py) -----------------------------------------------------
    def load_model(self) -> LoadedModel:
        """Rank 0's shard, loaded while the workers load theirs; then every rank's figures."""
        loaded = load_model(self.config, self.parallel)
        reports = self._receive_all("loaded")
        self.reports = [rank_report(0, loaded, self._rank_kv_bytes(0)), *reports]
        return loaded

    def kv_bytes_per_token(self, loaded: LoadedModel) -> int:
        """The most bytes per token any rank's pool takes (its KV heads): the pools have one size in blocks."""
        return max(self._rank_kv_bytes(rank) for rank in range(self.world_size))

    def size_kv_pool_on_gpu(self, loaded: LoadedModel, eos_token_ids: tuple[int, ...],
                            max_model_len: int) -> tuple[int, GpuMemoryPlan]:
        """Every rank profiles the same step and sizes its own pool; the pools take the smallest count."""
        config = self.config
        self._send_command([PROFILE, max_model_len])

        def make_runner() -> ModelRunner:  # its steps go to the workers too (the runner's step sink)
            return self._make_runner(loaded, 1, eos_token_ids)

        def profile() -> None:
            make_runner().profile_run(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
            torch.cuda.synchronize(config.torch_device)

        block_bytes = self._rank_kv_bytes(0) * config.block_size
        min_blocks = -(-max_model_len // config.block_size)
        profile_graphs = decode_graph_profiler(config, loaded.model_cfg.vocab_size, max_model_len, make_runner)
        plan = self._guard(lambda: plan_gpu_kv_cache(config, config.torch_device, loaded.weight_bytes, profile,
                                                     min_blocks * block_bytes, profile_graphs=profile_graphs))
        counts = [plan.kv_cache // block_bytes]
        for answer in self._receive_all("profiled"):
            if "error" in answer:  # that rank's memory cannot hold max_model_len tokens
                raise ValueError(answer["error"])
            counts.append(answer["num_blocks"])
        return min(counts), plan

    def start(self, loaded: LoadedModel, num_blocks: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        """Every rank's runner over a pool of `num_blocks` (its own KV heads); decode graphs on CUDA."""
        config = self.config
        capture = config.torch_device.type == "cuda" and not config.enforce_eager
        self._send_command([START, num_blocks, max_model_len, int(capture)])
        self.runner = self._make_runner(loaded, num_blocks, eos_token_ids)
        if capture:  # each rank captures its own step; the collectives are captured with it
            self._guard(lambda: self.runner.capture_decode_graphs(max_model_len))
        self._receive_all("ready")

    def execute(self, scheduled: list[ScheduledSeq], num_live_seqs: int,
                blocks_to_copy: list[tuple[int, int]] | None = None) -> list[StepResult]:
        # The workers receive the model's inputs only: a block copy on rank 0 alone would leave their
        # KV shards behind, so the engine refuses the requests that fork sequences (beam search,
        # scoring) before they get here (LLMEngine.check_tensor_parallel_support).
        if blocks_to_copy:
            raise RuntimeError("copy on write of KV blocks is not implemented with tensor parallelism")
        return self._guard(lambda: self.runner.execute(scheduled, num_live_seqs))

    def release(self, seq: Sequence) -> None:
        if self.runner is not None:
            self.runner.release(seq)

    def report(self) -> dict:
        """{size, ranks: [{rank, pid, device, weight_bytes, kv_bytes_per_token, max_rss_bytes}]}."""
        return {"size": self.world_size, "ranks": list(self.reports)}

    def shutdown(self) -> None:
        """Stop the workers (a command, then terminate what is left); idempotent."""
        self._finalizer()

    # ---- the step broadcast --------------------------------------------------------------------------
    def send_step(self, step: StepInputs, sent: torch.Tensor) -> None:
        """The runner's step sink: the header to every worker's pipe, then the step's model sections
        (the start of the buffer the runner just sent, `sent`; with a sliding-window block group, its
        local slots and tables after them) in one broadcast."""
        num_seqs = step.num_seqs
        width = step.block_tables_t.shape[1] if num_seqs else 0
        num_logits = step.logits_indices.shape[0]
        num_ints = sum(model_section_sizes(step.num_tokens, num_logits, num_seqs, width).values())
        if "w.slot_mapping" in step.tensors:  # a local block group's slots and tables, packed right after
            num_ints += step.num_tokens + num_seqs * width
        header = np.empty(STEP_HEADER_INTS + 2 * num_seqs, dtype=np.int32)
        header[:STEP_HEADER_INTS] = (STEP, num_ints, step.num_tokens, num_logits, num_seqs, width, step.num_decodes,
                                     step.max_seq_len)
        header[STEP_HEADER_INTS:STEP_HEADER_INTS + num_seqs] = step.query_lens
        header[STEP_HEADER_INTS + num_seqs:] = step.context_lens
        self._send_bytes(header.tobytes())
        self.parallel.group.broadcast(sent[:num_ints])

    # ---- the workers -------------------------------------------------------------------------------
    def check_workers(self) -> None:
        """Raise WorkerDiedError when a worker reported an error or its process ended."""
        if self.failure is not None:
            raise self.failure
        for index in range(len(self.processes)):
            self._pump(index)
        dead = [i for i, p in enumerate(self.processes) if p.exitcode is not None]
        if dead:
            raise self._fail(dead, None)

    def _check_alive(self) -> None:
        """The joining thread's look at the workers: a process that ended (named by check_workers)."""
        if any(p.exitcode is not None for p in self.processes):
            raise RuntimeError("a tensor-parallel worker ended before the group was joined")

    def _guard(self, run):
        """Run rank 0's part of a collective phase; any failure (a collective, a pipe, a worker gone, or
        rank 0's own) leaves the ranks out of step: it becomes WorkerDiedError and the engine stays failed."""
        if self.failure is not None:
            raise self.failure
        try:
            return run()
        except Exception as exc:  # the ranks are out of step from here on, whatever failed
            if isinstance(exc, WorkerDiedError):
                raise
            deadline = time.monotonic() + _DEATH_GRACE_S
            while time.monotonic() < deadline and all(p.exitcode is None for p in self.processes):
                time.sleep(0.02)
            raise self._fail([i for i, p in enumerate(self.processes) if p.exitcode is not None], exc) from exc

    def _fail(self, dead: list[int], cause: BaseException | None) -> WorkerDiedError:
        for index in dead:  # what a dead worker said before it went: its own error report raises here
            self._pump(index)
        if dead:
            what = "; ".join(f"tensor-parallel worker rank {i + 1} (pid {self.processes[i].pid}) "
                             f"{_exit_description(self.processes[i])}" for i in dead)
            if not all(self._said_hello[i] for i in dead):  # usually spawn re-running a script's top level
                what += (" before it started (its stderr says why; a script that builds an engine with "
                         "tensor_parallel_size > 1 keeps its top level under `if __name__ == \"__main__\":`, "
                         "since spawn imports it again in each worker)")
        else:
            what = "a tensor-parallel step failed on rank 0 with every worker still running"
        if cause is not None:
            what += f" ({_brief(cause)})"
        self.failure = WorkerDiedError(f"{what}: the engine cannot continue; the requests in flight are lost")
        log.error("%s", self.failure)
        self.shutdown()
        return self.failure

    def _send_bytes(self, data: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(data)

    def _send_command(self, values: list[int]) -> None:
        self._guard(lambda: self._send_bytes(np.asarray(values, dtype=np.int32).tobytes()))

    def _pump(self, index: int) -> None:
        """Move worker `index`'s waiting messages to its inbox; an error message fails the engine."""
        conn = self.conns[index]
        try:
            while conn.poll(0):
                kind, payload = conn.recv()
                if kind == "error":
                    raise self._fail_reported(index, payload)
                if kind == "hello":
                    self._said_hello[index] = True
                else:
                    self._inbox[index].append((kind, payload))
        except (EOFError, OSError):
            pass  # the process ended: check_workers names it

    def _fail_reported(self, index: int, message: str) -> WorkerDiedError:
        self.failure = WorkerDiedError(f"tensor-parallel worker rank {index + 1} (pid {self.processes[index].pid}) "
                                       f"failed: {message}")
        log.error("%s", self.failure)
        self.shutdown()
        return self.failure

    def _receive_all(self, kind: str) -> list:
        """Each worker's next `kind` message (rank order), waiting as long as it takes while they live."""
        answers = []
        for index in range(len(self.processes)):
            while True:
                self.check_workers()
                inbox = self._inbox[index]
                if inbox:
                    got, payload = inbox.popleft()
                    if got != kind:
                        raise RuntimeError(f"tensor-parallel worker rank {index + 1} answered {got!r}, "
                                           f"expected {kind!r}")
                    answers.append(payload)
                    break
                self.conns[index].poll(_POLL_S)
        return answers

    def _make_runner(self, loaded: LoadedModel, num_blocks: int, eos_token_ids: tuple[int, ...]) -> ModelRunner:
        runner = ModelRunner(self.config, loaded.model_cfg, loaded.model, num_blocks, eos_token_ids,
                             loaded.capabilities)
        runner.step_sink = self.send_step
        return runner

    def _rank_kv_bytes(self, rank: int) -> int:
        return kv_bytes_per_token(self.layouts[rank].rank_config(self.model_cfg), self.config.kv_torch_dtype)


def _brief(exc: BaseException) -> str:
    """An exception in one line, without gloo's source path and advice."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return f"{type(exc).__name__}: {text.split('. This is typically')[0]}"


def _rank_devices(device: torch.device, world_size: int) -> list[torch.device]:
    """Rank r's device: the CPU for every rank, or the r-th GPU from the configured one (cuda, cuda:N)."""
    if device.type != "cuda":
        return [device] * world_size
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + world_size > count:
        raise ValueError(f"tensor_parallel_size {world_size} from {device} needs GPUs {first}..{first + world_size - 1}; "
                         f"this machine shows {count}")
    return [torch.device("cuda", first + rank) for rank in range(world_size)]


def _watch(processes: list[multiprocessing.Process], stopping: threading.Event) -> None:
    """Log a worker's death as it happens (the next step then fails, naming it); holds no executor."""
    waiting = {p.sentinel: rank for rank, p in enumerate(processes, start=1)}
    while waiting:
        for sentinel in multiprocessing.connection.wait(list(waiting)):
            rank = waiting.pop(sentinel)
            if stopping.is_set():
                return
            process = processes[rank - 1]
            log.error("tensor-parallel worker rank %d (pid %d) %s", rank, process.pid, _exit_description(process))


def _stop_workers(processes: list[multiprocessing.Process], conns: list, stopping: threading.Event) -> None:
    """Ask each live worker to leave, then terminate (and at last kill) the ones that do not."""
    stopping.set()
    for process, conn in zip(processes, conns):
        if process.exitcode is None:
            try:
                conn.send_bytes(np.asarray([SHUTDOWN], dtype=np.int32).tobytes())
            except OSError:
                pass
    deadline = time.monotonic() + _JOIN_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.exitcode is None:
            process.terminate()
            process.join(1.0)
        if process.exitcode is None:
            process.kill()
            process.join(1.0)
    for conn in conns:
        conn.close()



"""A tensor-parallel worker process (ranks 1..N-1): its shard of the model, its KV pool, rank 0's steps.

Started by rank 0's executor (mp_executor.py) with multiprocessing's spawn. It joins the group, loads
only its shard (load_model with its layout), says so, and then follows rank 0's commands, which come
over its pipe as int32 headers (protocol below). A step's header carries its sizes and the host-side
lengths; the step's packed model inputs then arrive in ONE broadcast from rank 0's step buffer, which
this worker unpacks into the same views the runner built on rank 0 (step_inputs.unpack_model_sections)
and runs through its own ModelRunner's forward: the same eager-or-graph choice, the same collectives
in the same order. It never samples.

Between commands it waits on the pipe, looking every second whether rank 0 is still its parent; it
ends when rank 0 says so, when rank 0 is gone, or when a collective fails (the group's timeout, or a
peer that died), exiting non-zero in the last two cases.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.config import EngineConfig

log = logging.getLogger("batchgen.engine")

# Commands, the first int32 of every header rank 0 sends.
STEP = 1  # [STEP, content ints, T, N, S, W, num_decodes, max_seq_len, query_lens (S), context_lens (S)]
START = 2  # [START, num_blocks, max_model_len, capture_graphs]: the runner and its KV pool
PROFILE = 3  # [PROFILE, max_model_len]: size the GPU KV pool around the next STEP (a profiling step)
SHUTDOWN = 4  # [SHUTDOWN]
STEP_HEADER_INTS = 8
PARENT_CHECK_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with (pickled by spawn)."""

    config: EngineConfig  # rank 0's, with this rank's device
    rank: int
    world_size: int
    store_port: int
    parent_pid: int
    num_threads: int | None
    log_level: int


def rank_report(rank: int, loaded, kv_bytes_per_token: int) -> dict:
    """One rank's figures: its weights' bytes (tensor storage) and its process's peak resident memory."""
    return {"rank": rank, "pid": os.getpid(), "device": str(loaded.model.embed_tokens.weight.device),
            "weight_bytes": loaded.weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
            "max_rss_bytes": peak_resident_bytes()}


def peak_resident_bytes() -> int:
    """This process's peak resident memory: VmHWM (Linux; getrusage's ru_maxrss carries a parent's peak
    across the fork and exec that start a worker), else ru_maxrss."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_worker(spec: WorkerSpec, conn) -> None:
    """The process's entry point: load the shard, then serve rank 0's commands until told to stop."""
    _configure_logging(spec)
    conn.send(("hello", os.getpid()))
    try:
        worker = Worker(spec, conn)
    except Exception as exc:  # reported to rank 0, which names this rank in its error
        conn.send(("error", _describe(exc)))
        sys.exit(1)
    try:
        worker.serve()
    except Exception as exc:
        log.error("tensor-parallel rank %d stops: %s", spec.rank, _describe(exc))
        try:
            conn.send(("error", _describe(exc)))
        except OSError:
            pass
        sys.exit(1)


class Worker:
    def __init__(self, spec: WorkerSpec, conn):
        from batchgen.engine.kv.capacity import kv_bytes_per_token
        from batchgen.engine.loader.model_loader import load_model, read_model_config
        from batchgen.engine.loader.source import resolve_model
        from batchgen.engine.parallel import TensorParallel, TensorParallelGroup, TensorParallelLayout
        from batchgen.engine.runner.cpu_allocator import keep_freed_memory

        self.spec, self.conn, self.config = spec, conn, spec.config
        device = spec.config.torch_device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            keep_freed_memory()
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        group = TensorParallelGroup.connect(spec.store_port, spec.rank, spec.world_size, device,
                                            check_peers=self.check_parent)
        model_cfg = read_model_config(resolve_model(spec.config.model, spec.config.revision))
        layout = TensorParallelLayout.plan(model_cfg, spec.rank, spec.world_size)
        self.parallel = TensorParallel(layout, group, check_peers=self.check_parent)
        self.loaded = load_model(spec.config, self.parallel)
        self.kv_bytes_per_token = kv_bytes_per_token(self.loaded.model.cfg, spec.config.kv_torch_dtype)
        self.runner = None
        self.buffer = torch.empty(1 << 14, dtype=torch.int32, device=device)  # grows to the largest step
        conn.send(("loaded", rank_report(spec.rank, self.loaded, self.kv_bytes_per_token)))

    def check_parent(self) -> None:
        if os.getppid() != self.spec.parent_pid:
            raise RuntimeError(f"rank 0 (pid {self.spec.parent_pid}) is gone")

    def next_header(self) -> np.ndarray:
        while not self.conn.poll(PARENT_CHECK_S):
            self.check_parent()
        return np.frombuffer(self.conn.recv_bytes(), dtype=np.int32)

    def serve(self) -> None:
        while True:
            header = self.next_header()
            command = int(header[0])
            if command == STEP:
                self.run_step(header, self.runner)
            elif command == START:
                self.start(*(int(v) for v in header[1:4]))
            elif command == PROFILE:
                self.profile(int(header[1]))
            elif command == SHUTDOWN:
                return
            else:
                raise RuntimeError(f"unknown command {command} from rank 0")

    def make_runner(self, num_blocks: int):
        from batchgen.engine.runner.model_runner import ModelRunner

        loaded = self.loaded
        return ModelRunner(self.config, loaded.model_cfg, loaded.model, num_blocks, (), loaded.capabilities)

    def start(self, num_blocks: int, max_model_len: int, capture_graphs: int) -> None:
        self.runner = self.make_runner(num_blocks)
        if capture_graphs:
            self.runner.capture_decode_graphs(max_model_len)
        self.conn.send(("ready", None))

    def profile(self, max_model_len: int) -> None:
        """This rank's side of the GPU pool sizing: the profiling step rank 0 sends next, on a
        one-block runner, measured here; the blocks this rank's memory holds go back to rank 0."""
        from batchgen.engine.kv.gpu_memory import plan_gpu_kv_cache
        from batchgen.engine.runner.decode_graphs import decode_graph_profiler

        config = self.config
        runner = self.make_runner(1)

        def run_profiling_step(on_runner) -> None:
            header = self.next_header()
            if int(header[0]) != STEP:
                raise RuntimeError(f"expected a profiling step from rank 0, got command {int(header[0])}")
            self.run_step(header, on_runner)

        def profile_step() -> None:
            run_profiling_step(runner)
            torch.cuda.synchronize(config.torch_device)

        # Rank 0 sends the largest decode graph's step next (unless enforce_eager): sized the same way here.
        profile_graphs = decode_graph_profiler(config, self.loaded.model_cfg.vocab_size, max_model_len,
                                               lambda: self.make_runner(1), run_profiling_step)
        block_bytes = self.kv_bytes_per_token * config.block_size
        min_blocks = -(-max_model_len // config.block_size)
        try:
            plan = plan_gpu_kv_cache(config, config.torch_device, self.loaded.weight_bytes, profile_step,
                                     min_blocks * block_bytes, profile_graphs=profile_graphs)
        except ValueError as exc:  # this rank's memory cannot hold max_model_len tokens
            self.conn.send(("profiled", {"error": f"rank {self.spec.rank}: {exc}"}))
            return
        self.conn.send(("profiled", {"num_blocks": plan.kv_cache // block_bytes}))

    @torch.inference_mode()
    def run_step(self, header: np.ndarray, runner) -> None:
        """Receive the step's packed model inputs (one broadcast) and run this rank's forward."""
        from batchgen.engine.runner.step_inputs import (
            make_step_inputs,
            model_section_sizes,
            unpack_model_sections,
        )

        num_ints, num_tokens, num_logits, num_seqs, width, num_decodes, max_seq_len = (
            int(v) for v in header[1:STEP_HEADER_INTS])
        query_lens = header[STEP_HEADER_INTS:STEP_HEADER_INTS + num_seqs].tolist()
        context_lens = header[STEP_HEADER_INTS + num_seqs:STEP_HEADER_INTS + 2 * num_seqs].tolist()
        if num_ints > self.buffer.numel():
            self.buffer = torch.empty(max(num_ints, 2 * self.buffer.numel()), dtype=torch.int32,
                                      device=self.buffer.device)
        content = self.parallel.group.broadcast(self.buffer[:num_ints])
        tensors = unpack_model_sections(content, num_tokens, num_logits, num_seqs, width)
        if runner.windowed is not None:  # the local block group's slots and tables follow (add_local_table_sections)
            start = sum(model_section_sizes(num_tokens, num_logits, num_seqs, width).values())
            tensors["w.slot_mapping"] = content[start:start + num_tokens]
            tensors["w.block_tables"] = content[start + num_tokens:start + num_tokens + num_seqs * width].view(
                num_seqs, width)
        # Host block tables are not sent: the backends that run tensor-parallel (cpu, triton) read
        # the packed tables (model_loader.PARALLEL_ATTENTION_BACKENDS).
        step = make_step_inputs(tensors, query_lens, context_lens, [], num_decodes, max_seq_len,
                                self.config.block_size)
        runner.forward(step, runner.attention_metadata(step))
        runner.capture_if_pending()  # as rank 0 does after this step (calculate_kv_scales)


def _configure_logging(spec: WorkerSpec) -> None:
    """The engine's log lines on stderr, marked with the rank, at rank 0's level."""
    logger = logging.getLogger("batchgen")
    logger.setLevel(spec.log_level)
    logger.propagate = False  # one line per record, whatever the caller's module configured on import
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [rank {spec.rank}] %(name)s: %(message)s"))
    logger.addHandler(handler)


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"

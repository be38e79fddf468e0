"""Pipeline test helpers: one shared engine on the bundled model, job dicts that match it, a fake engine."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine import CompletionOutput, EngineConfig, RequestMetrics, RequestOutput
from batchgen.pipeline.config import JobConfig, validate_job
from batchgen.pipeline.job_settings import MODEL_KEYS
from tests.conftest import MODEL, TEST_ENGINE_KWARGS

# A short context keeps overlong/truncation cases cheap (a 250-token prefill, not a 4000-token one).
PIPELINE_ENGINE_KWARGS = {**TEST_ENGINE_KWARGS, "max_model_len": 256}


def engine_sections(kwargs: dict = PIPELINE_ENGINE_KWARGS, model: str = MODEL) -> dict:
    """The job's `model` and `engine` sections that build exactly EngineConfig(model, **kwargs)."""
    return {"model": {"path": model, **{k: v for k, v in kwargs.items() if k in MODEL_KEYS}},
            "engine": {k: v for k, v in kwargs.items() if k not in MODEL_KEYS}}


def make_job(tmp_path: Path, input_path: str, **sections) -> JobConfig:
    """A job on the shared engine's settings; `sections` replace or extend the defaults below."""
    raw = {"name": "test-job", **engine_sections(),
           "input": {"path": input_path, "prompt_column": "prompt"},
           "sampling": {"max_tokens": 4},
           "output": {"path": str(tmp_path / "out")}}
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    return validate_job(raw, tmp_path)


def write_parquet(path: Path, columns: dict, **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = columns if isinstance(columns, pa.Table) else pa.table(columns)
    pq.write_table(table, path, **kwargs)
    return path


def read_output(folder: Path | str) -> pa.Table:
    """All part files of an output folder, in unit order."""
    parts = sorted(Path(folder).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, engine):
    """A tiny random-weight Llama folder with the bundled model's tokenizer (already loaded by the
    session engine: no second read of the GGUF), for tests where the bundled model is not the point."""
    from tests.pipeline.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", engine.tokenizer.hf)


@pytest.fixture(scope="session")
def engine(llm):
    """The session model's weights with a 256-token context: the engine of every job built by make_job."""
    engine = llm.with_engine_settings(max_model_len=PIPELINE_ENGINE_KWARGS["max_model_len"]).engine
    assert engine.config == EngineConfig(model=MODEL, **PIPELINE_ENGINE_KWARGS)
    return engine


class _FakeTokenizer:
    has_chat_template = True


class FakeEngine:
    """The engine's pipeline-facing surface with no model: instant, deterministic, and it records calls.

    Each step finishes the oldest `max_num_seqs` requests, each sample with 3 tokens derived from
    the prompt, so tests of ordering, queue bounds, resume and the writer run in milliseconds.
    """

    def __init__(self, config: EngineConfig, max_model_len: int = 256):
        self.config = config
        self.max_model_len = max_model_len
        self.tokenizer = _FakeTokenizer()
        self.waiting: dict[str, tuple] = {}
        self.added: list[str] = []  # request ids in the order handed over
        self.sample_keys: dict[str, str | None] = {}  # request id -> the sample_key it was added with
        self.max_unfinished = 0
        self.num_steps = 0
        self.num_generated_tokens = 0

    @property
    def stats(self) -> dict:
        return {"prefix_cache_hit_rate": 0.0, "kernels": {"attention_backend": "fake"},
                "kv_cache": {"dtype": "float32", "bytes_per_token": 4},
                "num_generated_tokens": self.num_generated_tokens}

    def encode(self, prompt, allow_special_tokens: bool = True, chat=None) -> list[int]:
        text = prompt if isinstance(prompt, str) else "|".join(f"{m['role']}:{m['content']}" for m in prompt)
        return [ord(c) % 500 + 1 for c in text]

    def add_request(self, request_id, prompt, params, prompt_token_ids=None, sample_key=None) -> None:
        if request_id in self.waiting:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self.waiting[request_id] = (prompt_token_ids, params, time.monotonic())
        self.added.append(request_id)
        self.sample_keys[request_id] = sample_key
        self.max_unfinished = max(self.max_unfinished, len(self.waiting))

    def compile_grammar(self, constraint) -> None:
        """A structured-output constraint is taken as is (no tokenizer here to compile it for)."""

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        outputs = []
        for request_id in list(self.waiting)[:self.config.max_num_seqs]:
            token_ids, params, arrival = self.waiting.pop(request_id)
            now = time.monotonic()
            tokens = [t % 97 for t in token_ids[:3]]
            samples = [CompletionOutput(i, f"done {request_id}/{i}", tokens, -1.0, None, "length",
                                        first_scheduled_time=now, first_token_time=now, last_token_time=now)
                       for i in range(params.n)]
            self.num_generated_tokens += len(tokens) * params.n
            outputs.append(RequestOutput(request_id, token_ids, samples, 0, RequestMetrics(arrival, now, now, now)))
        return outputs


@pytest.fixture
def fake_engine_for():
    """fake_engine_for(job) -> a FakeEngine whose config equals the job's."""
    return lambda job, **kwargs: FakeEngine(job.engine_config(), **kwargs)


@pytest.fixture(scope="session")
def s3_options():
    """A moto S3 server on a free local port with bucket batchgen-test; pass as storage_options."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    fsspec.filesystem("s3", **options).mkdir("batchgen-test")
    yield options
    server.stop()


class GatedEngine(FakeEngine):
    """A FakeEngine that stops before step `gate_step` until `gate` is set: a run caught mid-job."""

    def __init__(self, config: EngineConfig, gate_step: int = 1, **kwargs):
        super().__init__(config, **kwargs)
        self.gate_step = gate_step
        self.paused = threading.Event()  # set once the run waits at the gate
        self.gate = threading.Event()

    def step(self) -> list[RequestOutput]:
        if self.num_steps == self.gate_step:
            self.paused.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return super().step()


class FailingEngine(FakeEngine):
    """Dies at step `fail_step` (a node preempted): earlier units are committed, later ones are not."""

    def __init__(self, config: EngineConfig, fail_step: int = 2, **kwargs):
        super().__init__(config, **kwargs)
        self.fail_step = fail_step

    def step(self) -> list[RequestOutput]:
        if self.num_steps == self.fail_step:
            raise RuntimeError("node preempted")
        return super().step()

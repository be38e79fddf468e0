"""One decode step moves its inputs to the device in one copy and reads back once (issue 13, shown 4).

The runner's input preparation is the CUDA path's, aimed at the `meta` device, so every host<->device
transfer is a dispatched `_to_copy`/`copy_` between devices and every scalar read a
`_local_scalar_dense`. The counting mode fakes the device-to-host results (meta tensors hold no data).
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.runner.decode_graphs import EagerCapturer
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sampling.sampling_params import SamplingParams
from tests.engine.step_fixtures import EOS, advance, decode, make_seq, prefill, tiny_runner

META = torch.device("meta")


class HostDataCounter(TorchFunctionMode):
    """`torch.tensor(data, device=...)` builds on the target device directly on meta (no dispatched
    copy), while on CUDA it is a host-to-device copy: counted here, at the Python level."""

    def __init__(self, transfers: list):
        super().__init__()
        self.transfers = transfers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            target = torch.device(kwargs["device"])
            if target.type != "cpu":
                self.transfers.append(("cpu", target.type))
        return func(*args, **kwargs)


class TransferCounter(TorchDispatchMode):
    """Records (source device, destination device) of cross-device copies and counts scalar reads."""

    def __init__(self):
        super().__init__()
        self.transfers: list[tuple[str, str]] = []
        self.scalar_reads = 0
        self.host_data = HostDataCounter(self.transfers)

    def __enter__(self):
        self.host_data.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self.host_data.__exit__(*exc)
        return result

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "item"):  # aten.item reaches the mode first in recent torch
            self.scalar_reads += 1
            return False if args[0].dtype == torch.bool else 0
        if name in ("_to_copy", "to"):  # aten.to reaches the mode in recent torch, _to_copy in others
            source = args[0].device
            target = torch.device(kwargs.get("device") or source)
            if source != target:
                self.transfers.append((source.type, target.type))
                if target.type == "cpu" and source.type == "meta":  # nothing to copy out of meta
                    return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if name == "copy_" and args[0].device != args[1].device:
            self.transfers.append((args[1].device.type, args[0].device.type))
            if args[0].device.type == "cpu":
                return args[0]
        return func(*args, **kwargs)


def assert_one_copy_each_way(counter: TransferCounter) -> None:
    assert counter.transfers == [("cpu", "meta"), ("meta", "cpu")], counter.transfers
    assert counter.scalar_reads == 0


def decode_step_on_meta(monkeypatch, *, graphs: bool):
    """A runner on meta with five sequences prefilled: greedy, a penalty row, min_tokens, top logprobs,
    and a sampled one (its keyed draw's key and position travel in the packed copy)."""
    runner = tiny_runner(META, monkeypatch=monkeypatch)
    params = [SamplingParams(temperature=0, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[3]),
              SamplingParams(temperature=0, max_tokens=8, logprobs=3),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=8)]
    seqs = [make_seq(f"r{i}", [1 + i, 2, 3, 4, 5][:3 + i % 3], p, first_block=1 + 4 * i) for i, p in enumerate(params)]
    with TransferCounter():  # the penalty row is made here, in the prefill step (meta reads need the mode)
        advance(runner.execute(prefill(seqs)))
    if graphs:
        runner.capture_decode_graphs(max_model_len=64, capturer=EagerCapturer())
    return runner, seqs


def test_the_counter_sees_each_kind_of_transfer():
    with TransferCounter() as counter:
        torch.tensor([1, 2, 3], device=META)
        y = torch.zeros(3, device=META)
        y.cpu()
        torch.ones(3).to(META)
        bool((y > 0).any())
    assert counter.transfers == [("cpu", "meta"), ("meta", "cpu"), ("cpu", "meta")]
    assert counter.scalar_reads == 1


@pytest.mark.parametrize("graphs", [False, True])
def test_a_decode_step_copies_its_inputs_once_and_reads_back_once(monkeypatch, graphs):
    runner, seqs = decode_step_on_meta(monkeypatch, graphs=graphs)
    with TransferCounter() as counter:
        results = runner.execute(decode(seqs))
    top = results[3].top_logprobs
    assert len(results) == len(seqs) and top is not None and len(top) == 3  # top-3 came back too
    assert_one_copy_each_way(counter)
    assert runner.penalties.rows  # the penalty row exists and was updated on the device


def test_an_added_item_call_fails_the_count(monkeypatch):
    """Negative control: the same step with one `.item()` in the sampler is caught."""
    runner, seqs = decode_step_on_meta(monkeypatch, graphs=False)
    original = Sampler.sample

    def sample_with_a_sync(self, logits, *args):
        logits.sum().item()
        return original(self, logits, *args)

    monkeypatch.setattr(Sampler, "sample", sample_with_a_sync)
    with TransferCounter() as counter:
        runner.execute(decode(seqs))
    with pytest.raises(AssertionError):
        assert_one_copy_each_way(counter)


def test_a_prefill_step_with_a_new_penalty_row_is_one_copy_too(monkeypatch):
    runner = tiny_runner(META, monkeypatch=monkeypatch)
    seq = make_seq("p", [4, 5, 6, 7], SamplingParams(temperature=0, presence_penalty=1.0, repetition_penalty=1.2),
                   first_block=1)
    with TransferCounter() as counter:
        runner.execute(prefill([seq]))
    assert_one_copy_each_way(counter)
    assert EOS == 95  # the fixture's EOS sits in the vocabulary


def test_a_verify_step_with_penalties_and_sampled_drafts_is_one_copy_too(monkeypatch):
    """Speculative decoding: every sequence verifies 3 drafts (a 4-token chunk, 4 sampled rows): the
    rows' positions, penalty deltas, min_tokens bans and which rows' tokens join the device counts all
    travel in the one packed copy and are judged on the device."""
    runner, seqs = decode_step_on_meta(monkeypatch, graphs=True)
    scheduled = []
    for seq in seqs:
        seq.draft_token_ids = [7, 8, 9]
        scheduled.append(ScheduledSeq(seq, 4, 3))
    with TransferCounter() as counter:
        results = runner.execute(scheduled)
    assert len(results) == 4 * len(seqs)
    assert_one_copy_each_way(counter)


class RecordingGrammar:
    """Stands in for a GrammarState (the tiny model has no tokenizer to compile for): allows every token
    and records which bitmask rows it was asked to fill, with which drafts."""

    def __init__(self):
        self.fills: list[tuple[int, list[int]]] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, drafts=()) -> None:
        assert bitmask.device.type == "cpu" and bitmask.dtype == torch.int32  # filled on the host
        bitmask[row:row + 1 + len(drafts)] = -1
        self.fills.append((row, list(drafts)))


def assert_one_extra_copy_for_the_bitmask(counter: TransferCounter) -> None:
    assert counter.transfers == [("cpu", "meta"), ("cpu", "meta"), ("meta", "cpu")], counter.transfers
    assert counter.scalar_reads == 0


@pytest.mark.parametrize("graphs", [False, True])
def test_a_decode_step_with_constrained_rows_adds_one_copy_only(monkeypatch, graphs):
    """Structured output: the constrained rows' bitmask, filled on the host, is the one extra copy;
    which logits rows it masks travels in the packed copy."""
    runner, seqs = decode_step_on_meta(monkeypatch, graphs=graphs)
    grammars = {1: RecordingGrammar(), 4: RecordingGrammar()}
    for i, grammar in grammars.items():
        seqs[i].grammar = grammar
    with TransferCounter() as counter:
        runner.execute(decode(seqs))
    assert_one_extra_copy_for_the_bitmask(counter)
    assert [g.fills for g in grammars.values()] == [[(0, [])], [(1, [])]]
    assert runner.step_bitmask.stats.num_masked_steps == 1 and runner.step_bitmask.stats.num_masked_rows == 2
    for seq in seqs:  # without a constrained row the step is back to one copy each way
        seq.grammar = None
    with TransferCounter() as counter:
        runner.execute(decode(seqs))
    assert_one_copy_each_way(counter)
    assert runner.step_bitmask.stats.num_masked_steps == 1


def test_a_verify_step_with_constrained_rows_is_one_extra_copy_too(monkeypatch):
    """Every sequence verifies 3 drafts; the constrained ones fill 4 rows each (one per draft prefix)."""
    runner, seqs = decode_step_on_meta(monkeypatch, graphs=True)
    grammar = RecordingGrammar()
    seqs[2].grammar = grammar
    scheduled = []
    for seq in seqs:
        seq.draft_token_ids = [7, 8, 9]
        scheduled.append(ScheduledSeq(seq, 4, 3))
    with TransferCounter() as counter:
        runner.execute(scheduled)
    assert_one_extra_copy_for_the_bitmask(counter)
    assert grammar.fills == [(0, [7, 8, 9])] and runner.step_bitmask.stats.num_masked_rows == 4


def test_a_step_launched_ahead_reads_its_pending_tokens_on_the_device(monkeypatch):
    """Async scheduling: the next decode step is launched before this one is collected; its input tokens
    (pending on the host) come from this step's sampled tokens by a gather on the device, inside its
    single copy in, packed into the other host buffer; collecting either waits for its queued read-back."""
    runner, seqs = decode_step_on_meta(monkeypatch, graphs=False)
    with TransferCounter():
        first = runner.launch(decode(seqs))
    first_buffer = runner.packer.buffer
    for s in first.sampling:
        s.seq.num_computed_tokens += 1
        s.seq.add_pending_token()
    fed = []
    feed = runner._feed
    runner._feed = lambda step, prev: fed.append(step.tensors["f.feed_rows"].shape) or feed(step, prev)
    with TransferCounter() as counter:
        second = runner.launch(decode(seqs))
    assert fed == [(len(seqs),)]  # every decode's input token read on the device
    assert_one_copy_each_way(counter)  # its copy in and its read-back (queued: the meta stand-in copies now)
    assert runner.packer.buffer is not first_buffer
    with TransferCounter() as counter:
        assert len(runner.collect(first)) == len(seqs) and len(runner.collect(second)) == len(seqs)
    assert counter.transfers == [] and counter.scalar_reads == 0

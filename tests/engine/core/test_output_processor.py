"""The output processor's stop rules, finishing and per-step outputs, without a model: a scheduler with
hand-made rows and a tokenizer whose every token is one letter."""

from __future__ import annotations

import copy

import pytest

from batchgen.engine.core.output_processor import OutputProcessor, RequestState
from batchgen.engine.core.outputs import RequestOutput, RequestOutputKind
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.runner.model_runner import StepResult
from batchgen.engine.sampling.sampling_params import SamplingParams
from tests.engine.core.test_scheduler import make_scheduler

EOS = 26  # decodes to "" with skip_special_tokens, "<eos>" without
MAX_MODEL_LEN = 64


class LetterTokenizer:
    """Token i < 26 is the letter chr(97 + i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) if i < 26 else ("" if skip_special_tokens else "<eos>") for i in ids)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.decode([i], skip_special_tokens=False) for i in ids]


def letters(text: str) -> list[int]:
    return [ord(c) - 97 for c in text]


class Harness:
    """A scheduler and its output processor; `run` feeds each sample its planned tokens, one per step."""

    def __init__(self):
        self.sched = make_scheduler(num_blocks=64, max_num_batched_tokens=256)
        self.released: list[Sequence] = []
        self.processor = OutputProcessor(LetterTokenizer(), (EOS,), self.sched, self.sched.kv_cache_manager,
                                         MAX_MODEL_LEN, self.released.append, is_speculative=False)

    def add(self, request_id: str, params: SamplingParams, prompt: list[int] | None = None) -> list[Sequence]:
        prompt = prompt or [1, 2, 3]
        seqs = [Sequence(request_id, i, prompt, params, 0.0, MAX_MODEL_LEN) for i in range(params.n)]
        self.processor.add(RequestState(request_id, prompt, seqs, 0.0, None, params.output_kind))
        for seq in seqs:
            self.sched.add(seq)
        return seqs

    def run(self, plans: dict[tuple[str, int], list[int]]) -> list[list[RequestOutput]]:
        """Step until nothing is unfinished: sample (request id, index) gets plans[...] in order (a short
        plan repeats its last token). The outputs of each step."""
        steps = []
        while self.sched.has_unfinished():
            out = self.sched.schedule()
            rows = []
            for s in out.scheduled:
                seq = s.seq
                plan = plans[(seq.request_id, seq.sample_index)]
                token = plan[min(seq.num_output_tokens, len(plan) - 1)]
                rows.append(StepResult(s, token, -0.25, [(token, -0.25), (0, -3.0)]))
            update = self.sched.update_from_output(out, rows, self.processor.is_stopped)
            steps.append(self.processor.process(update))
        return steps


def final(steps: list[list[RequestOutput]], request_id: str = "r") -> RequestOutput:
    [out] = [o for outs in steps for o in outs if o.request_id == request_id and o.finished]
    return out


def one(params: SamplingParams, tokens: list[int]):
    h = Harness()
    h.add("r", params)
    return final(h.run({("r", 0): tokens})).outputs[0]


def test_eos_ends_past_min_tokens_and_is_not_in_the_text():
    out = one(SamplingParams(max_tokens=10), letters("hi") + [EOS, 5])
    assert out.token_ids == letters("hi") + [EOS] and out.text == "hi"
    assert out.finish_reason == "stop" and out.stop_reason is None
    held = one(SamplingParams(max_tokens=10, min_tokens=3), letters("hi") + [EOS] + letters("ok") + [EOS])
    assert held.token_ids == letters("hi") + [EOS] + letters("ok") + [EOS]  # the first EOS came too early
    ignored = one(SamplingParams(max_tokens=5, ignore_eos=True), [EOS])
    assert ignored.token_ids == [EOS] * 5 and ignored.finish_reason == "length"


def test_a_stop_token_ends_with_its_id_as_stop_reason_and_stays_out_of_the_text_unless_asked():
    out = one(SamplingParams(max_tokens=10, stop_token_ids=[3]), letters("abcd"))
    assert out.token_ids == letters("abcd") and out.text == "abc" and out.stop_reason == 3
    kept = one(SamplingParams(max_tokens=10, stop_token_ids=[3], include_stop_str_in_output=True), letters("abcd"))
    assert kept.text == "abcd"


def test_stop_strings_cut_the_text_and_count_only_past_min_tokens():
    out = one(SamplingParams(max_tokens=20, stop=["cd", "zz"]), letters("abcdefg"))
    assert out.text == "ab" and out.stop_reason == "cd" and out.finish_reason == "stop"
    assert out.token_ids == letters("abcd")  # the token ids keep every generated token
    assert one(SamplingParams(max_tokens=20, stop=["cd"], include_stop_str_in_output=True),
               letters("abcdefg")).text == "abcd"
    # "cd" ends at the 4th token, inside min_tokens: it does not count; the later "cd" does.
    late = one(SamplingParams(max_tokens=20, stop=["cd"], min_tokens=4), letters("abcdxcdy"))
    assert late.text == "abcdx" and late.token_ids == letters("abcdxcd")


def test_max_tokens_and_max_model_len_end_with_length():
    assert one(SamplingParams(max_tokens=4), letters("abcdefg")).token_ids == letters("abcd")
    h = Harness()
    h.add("r", SamplingParams(max_tokens=100), prompt=list(range(MAX_MODEL_LEN - 3)))
    out = final(h.run({("r", 0): letters("abcdef")})).outputs[0]
    assert out.token_ids == letters("abc") and out.finish_reason == "length"


def test_a_request_finishes_with_its_last_sample_and_every_sample_is_released():
    h = Harness()
    seqs = h.add("r", SamplingParams(n=3, temperature=1.0, max_tokens=9, logprobs=1))
    steps = h.run({("r", 0): letters("ab") + [EOS], ("r", 1): letters("abcdef") + [EOS], ("r", 2): letters("a")})
    outputs = [o for outs in steps for o in outs]
    assert len(outputs) == 1 and outputs[0].finished  # FINAL_ONLY: one output, in the step of its last token
    assert steps[-1] == outputs and len(steps) == 9  # sample 2's 9 tokens, one per step
    out = outputs[0]
    assert [c.text for c in out.outputs] == ["ab", "abcdef", "aaaaaaaaa"]
    assert [c.finish_reason for c in out.outputs] == ["stop", "stop", "length"]
    assert out.outputs[0].logprobs == [-0.25] * 3 and out.outputs[0].top_logprobs[0][1] == (0, "a", -3.0)
    assert sorted(map(id, h.released)) == sorted(map(id, seqs)) and not h.processor.requests
    assert out.metrics.first_token_time <= out.metrics.last_token_time


@pytest.mark.parametrize("stop", [[], ["cd"]])
def test_delta_outputs_join_into_the_final_only_output(stop):
    """n = 2, the samples ending in different steps; with a stop string the streamed text holds back a
    character, and no piece sent is ever cut away."""
    plans = {("r", 0): letters("abcdefgh") + [EOS], ("r", 1): letters("xyzab") + [EOS]}
    outputs = {}
    for kind in RequestOutputKind:
        h = Harness()
        h.add("r", SamplingParams(n=2, temperature=1.0, max_tokens=12, logprobs=1, stop=stop, output_kind=kind))
        outputs[kind] = [o for outs in h.run(plans) for o in outs]
    [whole] = outputs[RequestOutputKind.FINAL_ONLY]
    deltas = outputs[RequestOutputKind.DELTA]
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert len(deltas) > 3  # one per step
    joined = copy.deepcopy(deltas[0])  # add() extends it in place
    for delta in deltas[1:]:
        joined = joined.add(delta)
    strip = (lambda o: [(c.index, c.text, c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason, c.stop_reason)
                        for c in o.outputs])
    assert strip(joined) == strip(whole)
    # Each sample's end is sent once, in the step it finished (the first one's before the request's end).
    ends = [(i, c.index) for i, d in enumerate(deltas) for c in d.outputs if c.finish_reason]
    assert sorted(index for _, index in ends) == [0, 1] and ends[0][0] < len(deltas) - 1
    streamed = "".join(c.text for d in deltas[:-1] for c in d.outputs if c.index == 0)
    assert whole.outputs[0].text.startswith(streamed)
    if stop:
        assert whole.outputs[0].text == "ab" and whole.outputs[1].text == "xyzab"
        assert all("c" not in c.text for d in deltas for c in d.outputs if c.index == 0)
    cumulative = outputs[RequestOutputKind.CUMULATIVE]
    assert strip(cumulative[-1]) == strip(whole) and cumulative[-1].finished
    for earlier in cumulative[:-1]:  # each an unfinished whole-so-far: a prefix of the final
        assert not earlier.finished
        for c, w in zip(earlier.outputs, whole.outputs):
            assert w.token_ids[:len(c.token_ids)] == c.token_ids and w.text.startswith(c.text)


def test_samples_that_stop_in_the_same_step_give_one_output():
    h = Harness()
    h.add("r", SamplingParams(n=2, temperature=1.0, max_tokens=9))
    h.add("q", SamplingParams(max_tokens=9))
    steps = h.run({("r", 0): letters("ab") + [EOS], ("r", 1): letters("cd") + [EOS],
                   ("q", 0): letters("xyz") + [EOS]})
    assert [[o.request_id for o in outs] for outs in steps] == [[], [], ["r"], ["q"]]
    assert [c.text for c in final(steps).outputs] == ["ab", "cd"] and len(h.released) == 3

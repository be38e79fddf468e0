"""Device-side penalty counts updated incrementally, and stop strings found in the new text only."""

from __future__ import annotations

import torch

from batchgen.engine.decoding.stop_strings import IncrementalText, find_stop_string
from batchgen.engine.sampling.sampler import apply_penalties
from batchgen.engine.sampling.sampling_params import SamplingParams
from tests.engine.step_fixtures import advance, decode, make_seq, prefill, tiny_runner

CPU = torch.device("cpu")


def test_penalties_from_device_counts_match_the_reference_over_steps_and_row_reuse():
    runner = tiny_runner(CPU)
    sampler = runner.sampler
    checked = []

    class Checking:
        """Greedy under penalties: the token must be the argmax of the per-row reference penalties."""

        def sample(self, logits, batch, seqs, penalties):
            expected = apply_penalties(logits.clone(), seqs).argmax(-1)
            out = sampler.sample(logits, batch, seqs, penalties)
            assert out.tokens.tolist() == expected.tolist()
            checked.append(len(seqs))
            return out

    runner.sampler = Checking()
    penalized = [SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=32),
                 SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=1.0, max_tokens=32),
                 SamplingParams(temperature=0, max_tokens=32)]
    first = [make_seq(f"a{i}", [5, 6, 7, 5, 8][:4 + i % 2], p, first_block=1 + 4 * i) for i, p in enumerate(penalized)]
    advance(runner.execute(prefill(first)))
    for _ in range(6):
        advance(runner.execute(decode(first)))
    rows = dict(runner.penalties.rows)
    assert len(rows) == 2  # the plain row holds none
    counts = runner.penalties.output_counts
    for seq in first[:2]:  # the counts are the output tokens' bincount, built on the device
        expected = torch.bincount(torch.tensor(seq.output_token_ids), minlength=96)
        assert counts[rows[seq]].tolist() == expected.tolist()
    for seq in first:
        runner.release(seq)
    # A new sequence takes a freed row: it starts from its own tokens, not the old ones.
    second = make_seq("b", [9, 10, 11], penalized[1], first_block=13)
    advance(runner.execute(prefill([second])))
    assert runner.penalties.rows[second] in rows.values()
    for _ in range(4):
        advance(runner.execute(decode([second])))
    assert len(checked) == 1 + 6 + 1 + 4


class FakeTokenizer:
    """Token t decodes as its text; 50 is half of a two-token character (U+FFFD until 51 follows)."""

    texts = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " S", 7: "TOP", 8: "x"}

    def __init__(self):
        self.decoded_tokens = 0

    def decode(self, ids):
        self.decoded_tokens += len(ids)
        out, i = [], 0
        while i < len(ids):
            if ids[i] == 50:
                out.append("é" if i + 1 < len(ids) and ids[i + 1] == 51 else "\ufffd")
                i += 2 if i + 1 < len(ids) and ids[i + 1] == 51 else 1
                continue
            out.append(self.texts.get(ids[i], ""))
            i += 1
        return "".join(out)


def test_incremental_text_decodes_only_the_newest_tokens():
    tokenizer = FakeTokenizer()
    state = IncrementalText()
    prompt = [8, 8, 8]
    tokens = list(prompt)
    outputs = [1, 2, 3, 4, 50, 51, 5] * 20
    for t in outputs:
        tokens.append(t)
        state.update(tokenizer.decode, tokens, len(prompt))
    assert state.text == tokenizer.decode(outputs)
    # Each step decodes a window of a few tokens, not the whole output (140 tokens here).
    assert tokenizer.decoded_tokens < 6 * len(outputs)


def test_stop_strings_across_token_boundaries_and_the_earliest_wins():
    assert find_stop_string("Hello wor", ["world"], 0) is None
    assert find_stop_string("Hello world", ["world"], len("Hello wor")) == (6, "world")
    assert find_stop_string("Hello world STOP", ["STOP", "world"], 0) == (6, "world")
    assert find_stop_string("Hello world STOP", ["STOP", "world"], 12) == (12, "STOP")  # world was checked
    assert find_stop_string("abc", ["c"], 3) is None  # nothing new past the checked text

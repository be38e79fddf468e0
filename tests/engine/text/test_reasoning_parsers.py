"""Reasoning parsers on outputs in their models' own formats: whole, and streamed in pieces cut anywhere
(a tag split between two deltas), with and without a closed </think>."""

from __future__ import annotations

import pytest

from batchgen.engine.text.reasoning import ReasoningStream, get_reasoning_parser

# DeepSeek-R1-Distill-Qwen: the template ends the prompt with "<think>\n", so the output starts inside
# the thinking and has no start tag.
R1_OUTPUT = ("Okay, so I need to figure out what 9.11 minus 9.8 is. Hmm, let me line up the decimals.\n"
             "9.11 - 9.80 = -0.69.\n</think>\n\nTo subtract **9.8** from **9.11**:\n\n\\[ 9.11 - 9.80 = -0.69 \\]\n\n"
             "**Answer:** \\(\\boxed{-0.69}\\)")
R1_REASONING = ("Okay, so I need to figure out what 9.11 minus 9.8 is. Hmm, let me line up the decimals.\n"
                "9.11 - 9.80 = -0.69.\n")
R1_ANSWER = "To subtract **9.8** from **9.11**:\n\n\\[ 9.11 - 9.80 = -0.69 \\]\n\n**Answer:** \\(\\boxed{-0.69}\\)"
# DeepSeek-R1-0528 writes the start tag itself.
R1_0528_OUTPUT = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help you today?"
# Qwen3-8B with enable_thinking true (the model opens the block).
QWEN3_THINKING = ("<think>\nOkay, the user is asking for the capital of France. That's Paris.\n</think>\n\n"
                  "The capital of France is **Paris**.")
# Qwen3-8B with enable_thinking false: the template renders "<think>\n\n</think>\n\n" in the prompt.
QWEN3_NO_THINKING = "The capital of France is **Paris**."
# max_tokens cut the thinking: no closing tag.
R1_CUT = "Let me think about this carefully. First, the integral of x^2 is x^3/3, so from 0 to"


def stream_pieces(parser, text: str, cuts: list[int], is_opened: bool = False) -> tuple[str | None, str]:
    stream = ReasoningStream(parser, is_opened)
    reasoning, content = "", ""
    bounds = [0, *cuts, len(text)]
    for start, end in zip(bounds, bounds[1:]):
        r, c = stream.feed(text[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return (reasoning + r if stream.has_thought else None), content + c


@pytest.mark.parametrize("name, text, is_opened, reasoning, answer", [
    ("deepseek_r1", R1_OUTPUT, True, R1_REASONING, R1_ANSWER),
    ("deepseek_r1", R1_OUTPUT, False, R1_REASONING, R1_ANSWER),  # R1 thinks even without the prompt's tag
    ("deepseek_r1", R1_0528_OUTPUT, False, "\nThe user greets me. I should greet back.\n",
     "Hello! How can I help you today?"),
    ("deepseek_r1", R1_CUT, True, R1_CUT, ""),
    ("qwen3", QWEN3_THINKING, False, "\nOkay, the user is asking for the capital of France. That's Paris.\n",
     "The capital of France is **Paris**."),
    ("qwen3", QWEN3_NO_THINKING, False, None, QWEN3_NO_THINKING),
    ("qwen3", "<think>\nStill thinking about", False, "\nStill thinking about", ""),  # cut, unclosed
    ("qwen3", R1_OUTPUT, True, R1_REASONING, R1_ANSWER),  # a thinking-only template opened the block
])
def test_split_whole_and_streamed_at_every_cut(name, text, is_opened, reasoning, answer):
    parser = get_reasoning_parser(name)
    assert parser.split(text, is_opened) == (reasoning, answer)
    for cut in range(len(text) + 1):  # two pieces: every tag split at every character
        assert stream_pieces(parser, text, [cut], is_opened) == (reasoning, answer), cut
    for size in (1, 2, 3, 5):  # many small pieces
        assert stream_pieces(parser, text, list(range(size, len(text), size)), is_opened) == (reasoning, answer)


def test_a_partial_end_tag_is_held_back_then_given_out():
    stream = ReasoningStream(get_reasoning_parser("deepseek_r1"), True)
    assert stream.feed("a < b </thi") == ("a < b ", "")  # "</thi" may be the end tag
    assert stream.feed("s is not it") == ("</this is not it", "")
    assert stream.feed("</think>\n\nyes") == ("", "yes")


def test_opened_by_prompt():
    parser = get_reasoning_parser("qwen3")
    assert parser.is_opened_by_prompt("<|im_start|>assistant\n<think>\n")
    assert not parser.is_opened_by_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_unknown_parser_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; known: deepseek_r1, qwen3"):
        get_reasoning_parser("r1")

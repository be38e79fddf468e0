"""vLLM's offline API on the real model: LLM.chat (one conversation or a batch, template settings),
the prompt dicts generate takes, get_tokenizer, and generation_config defaults.

The reference for a rendered conversation is transformers' own apply_chat_template on the same
tokenizer (get_tokenizer() is it), encoded as vLLM encodes a rendered chat (no added special tokens).
"""

from __future__ import annotations

import inspect
import json

import pytest

from batchgen.engine import SamplingParams
from batchgen.engine.text.chat_template import RESERVED_TEMPLATE_KWARGS
from tests.engine.prompts import QUESTIONS, chat

GREEDY = SamplingParams(temperature=0, max_tokens=8)
# A template of our own: no default system prompt, one line per message.
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}{{ greeting | default('') }}assistant:{% endif %}")


def rendered_ids(hf, messages, **kwargs) -> list[int]:
    text = hf.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **kwargs})
    return hf.encode(text, add_special_tokens=False)


def test_chat_of_one_conversation_and_of_a_batch_equal_generate_on_the_rendered_prompts(llm):
    hf = llm.get_tokenizer()
    conversations = [chat(q) for q in QUESTIONS[:3]]
    reference = llm.generate([{"prompt_token_ids": rendered_ids(hf, c)} for c in conversations], GREEDY)

    single = llm.chat(conversations[0], GREEDY)
    batch = llm.chat(conversations, GREEDY)
    assert len(single) == 1 and len(batch) == 3
    assert single[0].prompt_token_ids == reference[0].prompt_token_ids
    assert single[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    # In input order, token for token.
    assert [o.prompt_token_ids for o in batch] == [r.prompt_token_ids for r in reference]
    assert [o.outputs[0].token_ids for o in batch] == [r.outputs[0].token_ids for r in reference]
    assert [o.outputs[0].text for o in batch] == [r.outputs[0].text for r in reference]


def test_chat_template_settings_reach_the_template(llm):
    hf = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "Name a color."}]
    out = llm.chat(conversation, GREEDY, chat_template=PLAIN_TEMPLATE, chat_template_kwargs={"greeting": "Ahoy "})
    expected = hf.encode("user: Name a color.\nAhoy assistant:", add_special_tokens=False)
    assert out[0].prompt_token_ids == expected

    # continue_final_message: the assistant's last message stays open, no new turn starts.
    partial = conversation + [{"role": "assistant", "content": "The color is"}]
    cont = llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert cont[0].prompt_token_ids == rendered_ids(hf, partial, add_generation_prompt=False,
                                                    continue_final_message=True)
    assert hf.decode(cont[0].prompt_token_ids).endswith("The color is")

    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt false"):
        llm.chat(partial, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set tokenize"):
        llm.chat(conversation, GREEDY, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="does not render a user message"):
        llm.chat(conversation, GREEDY, chat_template="{{ raise_exception('no users here') }}")


def test_reserved_template_kwargs_are_the_arguments_of_apply_chat_template(llm):
    # A newer transformers with a new argument would let a template kwarg of that name clash silently.
    arguments = set(inspect.signature(llm.get_tokenizer().apply_chat_template).parameters) - {"kwargs"}
    assert arguments <= RESERVED_TEMPLATE_KWARGS


def test_generate_takes_vllms_prompt_dicts_and_token_lists(llm):
    hf = llm.get_tokenizer()
    text = "The capital of France is"
    ids = hf.encode(text)
    outputs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}, ids,
                            {"prompt_token_ids": ids, "prompt": text}], GREEDY)
    assert all(o.prompt_token_ids == ids for o in outputs)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert [o.prompt for o in outputs] == [text, text, None, None, text]
    one = llm.generate({"prompt_token_ids": ids}, GREEDY)  # a single dict is one prompt
    assert len(one) == 1 and one[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert llm.generate([], GREEDY) == []


@pytest.mark.parametrize("prompts, error, match", [
    ([{"prompt_token_ids": [1, 2], "role": "user"}], TypeError, "unknown key.*'role'"),
    ({"text": "hi"}, TypeError, "unknown key.*'text'.*prompt_token_ids"),
    (42, TypeError, r"cannot read prompts of type int: a prompt is a string, \{'prompt': str\}"),
    ([["a", "b"]], TypeError, "cannot read prompts of type list of list"),
    ([{"prompt": "hi", "multi_modal_data": {}}], ValueError, "multi_modal_data is not supported"),
    ([{"prompt_token_ids": [1, 10**9]}], ValueError, "outside the vocabulary"),
])
def test_an_unknown_prompt_form_is_refused_naming_the_accepted_forms(llm, prompts, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, GREEDY)


def test_generation_config_defaults_apply_without_sampling_params(llm, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.0, "top_k": 0, "repetition_penalty": 1.3, "max_new_tokens": 5}))
    tuned = llm.with_engine_settings(generation_config=str(tmp_path), max_model_len=512, num_kv_blocks=32)
    defaults = tuned.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty, defaults.max_tokens) == (0.0, -1, 1.3, 5)
    prompt = chat(QUESTIONS[1])
    out = tuned.chat(prompt)[0].outputs[0]  # sampling_params=None: the file's defaults (vLLM's rule)
    expected = llm.chat(prompt, SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=5))[0].outputs[0]
    assert out.token_ids == expected.token_ids and len(out.token_ids) == 5
    # Given SamplingParams are used as they are.
    assert tuned.chat(prompt, GREEDY)[0].outputs[0].token_ids == llm.chat(prompt, GREEDY)[0].outputs[0].token_ids
    # The bundled GGUF has no generation_config.json: auto gives SamplingParams' own defaults.
    assert llm.engine.config.generation_config == "auto" and llm.engine.generation_defaults.values == {}
    with pytest.raises(ValueError, match="no generation_config.json there"):
        llm.with_engine_settings(generation_config=str(tmp_path / "missing"), max_model_len=512, num_kv_blocks=32)


def test_an_engine_seed_keys_unseeded_requests(llm):
    params = SamplingParams(temperature=1.0, max_tokens=8)
    prompt = chat(QUESTIONS[2])
    runs = [llm.with_engine_settings(seed=seed, max_model_len=512, num_kv_blocks=32).chat([prompt, prompt], params)
            for seed in (7, 7, 8)]
    tokens = [[o.outputs[0].token_ids for o in run] for run in runs]
    assert tokens[0] == tokens[1]  # the same seed from a fresh LLM: the same samples
    assert tokens[0] != tokens[2]  # another seed: other draws


def test_a_call_that_fails_midway_leaves_nothing_queued(llm):
    # The third prompt is too long: the two before it are aborted, not left for the next call to run.
    too_long = [1] * (llm.engine.max_model_len + 1)
    free_before = llm.engine.kv_cache_manager.pool.num_free_blocks
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([QUESTIONS[0], QUESTIONS[1], too_long], SamplingParams(temperature=0, max_tokens=4))
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv_cache_manager.pool.num_free_blocks == free_before
    [out] = llm.generate(QUESTIONS[2], SamplingParams(temperature=0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4

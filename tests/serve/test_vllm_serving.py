"""`batchgen serve` as a vLLM user starts it: a Hugging Face repo id at a revision (from an HF cache
layout, HF_HUB_OFFLINE=1), --chat-template FILE, --generation-config FOLDER, and --seed; vLLM's request
fields chat_template_kwargs, add_generation_prompt / continue_final_message and
include_stop_str_in_output; streamed text equal to the whole text under min_tokens and stop strings.

One server for the module (started before the `llm` fixture loads, so the loads overlap); the --seed
test starts two more, side by side.
"""

from __future__ import annotations

import json

import httpx
import jinja2
import pytest

from batchgen.engine import SamplingParams
from tests.hub_cache import make_hub_cache
from tests.pipeline.tiny_model import write_tiny_model
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.server

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}{{ greeting | default('') }}assistant:{% endif %}")
GENERATION_CONFIG = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 6, "do_sample": True}
SEA = "Write three short lines about the sea:\n"  # greedy: "\nThe sea is a vast and mysterious realm, ..."


@pytest.fixture(scope="module")
def hub(tmp_path_factory, smollm_path):
    return make_hub_cache(tmp_path_factory.mktemp("hf-cache"), smollm_path)


@pytest.fixture(scope="module")
def server_process(tmp_path_factory, hub):
    folder = tmp_path_factory.mktemp("serve-vllm")
    (folder / "chat.jinja").write_text(TEMPLATE)
    (folder / "gen").mkdir()
    (folder / "gen" / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    server = ServerProcess(folder / "server.log", "--revision", "v1", "--chat-template", str(folder / "chat.jinja"),
                           "--generation-config", str(folder / "gen"), "--max-num-seqs", "8",
                           model=hub.repo_id, env=hub.env)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(server_process, llm):
    return server_process.wait_ready()


def post(server: ServerProcess, endpoint: str, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{endpoint}", json=body, timeout=120)


def streamed_text(server: ServerProcess, endpoint: str, **body) -> str:
    pieces = []
    with httpx.stream("POST", f"{server.base_url}/v1/{endpoint}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def rendered_ids(llm, content: str, **variables) -> list[int]:
    """The reference prompt: jinja2 renders the template, the tokenizer encodes it as a rendered chat."""
    text = jinja2.Template(TEMPLATE).render(messages=[{"role": "user", "content": content}],
                                            add_generation_prompt=True, **variables)
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_a_repo_id_at_a_revision_is_served_with_its_sampling_defaults_logged(server, hub):
    models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(hub.repo_id, hub.repo_id)]
    assert "sampling defaults: generation_config" in server.output()
    assert "temperature=0.0, repetition_penalty=1.3, max_tokens=6" in server.output()


def test_the_chat_template_file_and_a_requests_kwargs_render_the_prompt(server, llm):
    messages = [{"role": "user", "content": "Name a fruit."}]
    plain = post(server, "chat/completions", messages=messages, max_tokens=4).json()
    ids = rendered_ids(llm, "Name a fruit.")
    assert plain["usage"]["prompt_tokens"] == len(ids)
    # No temperature or repetition_penalty in the request: generation_config.json's apply.
    expected = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4,
                                                                      repetition_penalty=1.3))[0].outputs[0]
    assert plain["choices"][0]["message"]["content"] == expected.text

    greeted = post(server, "chat/completions", messages=messages, max_tokens=4,
                   chat_template_kwargs={"greeting": "Ahoy there, "}).json()
    with_greeting = rendered_ids(llm, "Name a fruit.", greeting="Ahoy there, ")
    assert greeted["usage"]["prompt_tokens"] == len(with_greeting) > len(ids)

    partial = messages + [{"role": "assistant", "content": "My fruit is"}]
    continued = post(server, "chat/completions", messages=partial, max_tokens=4, add_generation_prompt=False,
                     continue_final_message=True).json()
    continued_text = jinja2.Template(TEMPLATE).render(messages=partial, add_generation_prompt=False)
    # transformers' continue_final_message: the text ends where the final message's content does.
    continued_text = continued_text[:continued_text.rindex("My fruit is") + len("My fruit is")]
    assert continued["usage"]["prompt_tokens"] == len(llm.get_tokenizer().encode(continued_text,
                                                                                  add_special_tokens=False))


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
])
def test_template_fields_that_cannot_apply_are_400_naming_the_field(server, body, param):
    reply = post(server, "chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, **body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_generation_config_defaults_apply_and_a_requests_own_values_win(server, llm):
    ids = rendered_ids(llm, "Describe the sea.")
    messages = [{"role": "user", "content": "Describe the sea."}]
    defaults = post(server, "chat/completions", messages=messages).json()
    expected = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, repetition_penalty=1.3,
                                                                      max_tokens=6))[0].outputs[0]
    assert defaults["usage"]["completion_tokens"] == len(expected.token_ids) == 6  # max_new_tokens
    assert defaults["choices"][0]["message"]["content"] == expected.text

    own = post(server, "chat/completions", messages=messages, temperature=0, repetition_penalty=1.0,
               max_tokens=9).json()
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=9))[0].outputs[0]
    assert own["usage"]["completion_tokens"] == 9 and own["choices"][0]["message"]["content"] == plain.text


@pytest.mark.parametrize("stop, min_tokens, include", [(["\n"], 3, False), (["e"], 3, False), (["e"], 3, True)])
def test_streamed_text_equals_the_whole_text_under_min_tokens_and_stops(server, llm, stop, min_tokens, include):
    body = {"prompt": SEA, "max_tokens": 16, "temperature": 0, "repetition_penalty": 1.0, "stop": stop,
            "min_tokens": min_tokens, "include_stop_str_in_output": include}
    expected = llm.generate(SEA, SamplingParams(temperature=0, max_tokens=16, stop=stop, min_tokens=min_tokens,
                                                include_stop_str_in_output=include))[0].outputs[0]
    assert expected.text  # the stop in the first min_tokens tokens ("\n", "The sea") cut nothing
    whole = post(server, "completions", **body).json()["choices"][0]
    assert whole["text"] == expected.text and whole["finish_reason"] == expected.finish_reason
    assert streamed_text(server, "completions", **body) == expected.text


def test_a_server_seed_reproduces_unseeded_requests_across_restarts(tmp_path, llm):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 1.0, "max_tokens": 8}
    # Two starts from scratch with the same --seed (side by side: their loads overlap), on a tiny
    # random-weight model with the bundled tokenizer: the seed's keys are the server's, not the model's,
    # and near-uniform logits make two unseeded draws of 8 tokens from one prompt differ.
    model = write_tiny_model(tmp_path / "tiny", llm.get_tokenizer())
    starts = [ServerProcess(tmp_path / f"seed-{i}.log", "--seed", "7", "--max-num-seqs", "4",
                            "--max-model-len", "256", model=str(model)) for i in range(2)]
    try:
        answers = [[post(start.wait_ready(), "chat/completions", **body).json()["choices"][0]["message"]["content"]
                    for _ in range(2)] for start in starts]
    finally:
        for start in starts:
            start.stop()
    assert answers[0] == answers[1]  # the same requests in the same order: the same samples
    assert answers[0][0] != answers[0][1]  # each request its own draws

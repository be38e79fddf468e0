"""`/classify` and `/pooling` through HTTP on `batchgen serve` of a tiny random reward model: shapes as
vLLM's docs give them, values equal HF `AutoModelForSequenceClassification`'s float32 logits (raw, or
through vLLM's classify activation), chat messages scored whole, bad bodies a 400 naming the field
(and a generation request to a pooling model too)."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.serve.server_process import ServerProcess
from tests.tiny_reward import conversation, hf_rewards, pairs, tiny_reward_model  # noqa: F401  (fixture)

pytestmark = pytest.mark.server
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(tiny_reward_model, tmp_path_factory):  # noqa: F811
    _, folder = tiny_reward_model
    process = ServerProcess(tmp_path_factory.mktemp("serve") / "server.log", "--max-model-len", "256",
                            "--served-model-name", "rm", model=str(folder))
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def test_pooling_and_classify_answer_as_vllm_with_hf_values(server, tiny_reward_model, hf_tokenizer):  # noqa: F811
    hf, _ = tiny_reward_model
    texts = ["the cat sat on a warm mat", "seven ships sailed north toward bright harbours"]
    reference = hf_rewards(hf, [hf_tokenizer(t)["input_ids"] for t in texts], batched=False)  # (2, 1)

    pooled = httpx.post(f"{server.base_url}/pooling", json={"model": "rm", "input": texts}, timeout=60).json()
    assert pooled["object"] == "list" and pooled["id"].startswith("pool-") and pooled["model"] == "rm"
    assert [d["index"] for d in pooled["data"]] == [0, 1] and pooled["data"][0]["object"] == "pooling"
    assert (torch.tensor([d["data"] for d in pooled["data"]]) - reference).abs().max().item() <= TOLERANCE
    num_tokens = sum(len(hf_tokenizer(t)["input_ids"]) for t in texts)
    assert pooled["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                               "prompt_tokens_details": None}

    classified = httpx.post(f"{server.base_url}/classify", json={"input": texts[0]}, timeout=60).json()
    [item] = classified["data"]
    assert classified["id"].startswith("classify-") and item["num_classes"] == 1 and item["label"] == "LABEL_0"
    assert item["probs"] == pytest.approx(torch.sigmoid(reference[0]).tolist(), abs=1e-5)


def test_messages_are_scored_whole_with_the_chat_template(server, tiny_reward_model, hf_tokenizer):  # noqa: F811
    hf, _ = tiny_reward_model
    messages, completion = pairs()[5]
    chat = conversation(messages, completion)
    reference = hf_rewards(hf, [hf_tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)],
                           batched=False)
    reply = httpx.post(f"{server.base_url}/v1/pooling", json={"messages": chat}, timeout=60).json()
    assert abs(reply["data"][0]["data"][0] - reference[0, 0].item()) <= TOLERANCE


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": "x", "encoding_format": "base64"}, "encoding_format"),
    ({"input": [5] * 300}, "input"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_bodies_are_400_naming_the_field(server, body, param):
    reply = httpx.post(f"{server.base_url}/pooling", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"}, timeout=60).status_code == 400

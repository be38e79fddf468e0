"""lm-evaluation-harness against `batchgen serve`, as against vLLM: a multiple-choice task through
`local-completions` (loglikelihood: echo + logprobs over token-id prompts, the tokenizer through the
server's /tokenize) and a generate_until task through `local-chat-completions`, on local task files (no
download); every item's answer equals lm-eval's own `hf` backend on HF transformers' float32 model. Then
the server's echo, prompt_logprobs and beam search fields against HF and LLM.beam_search, and the
combinations it refuses.

One server subprocess for the module (the bundled model, the `llm` fixture's settings).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from batchgen.engine import BeamSearchParams, SamplingParams
from tests.conftest import MODEL
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.server

MC_ITEMS = [
    ("The capital of France is", ["Paris", "London", "Rome", "Madrid"], 0),
    ("Two plus two equals", ["four", "five", "seven", "ten"], 0),
    ("The color of the sky on a clear day is", ["blue", "green", "red", "purple"], 0),
    ("Water freezes at a temperature of zero degrees", ["Celsius", "Kelvin", "Rankine", "Newton"], 0),
    ("The largest planet in our solar system is", ["Jupiter", "Mars", "Venus", "Mercury"], 0),
    ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"], 0),
    ("The opposite of hot is", ["cold", "warm", "loud", "tall"], 0),
    ("Bees make", ["honey", "milk", "silk", "wool"], 0),
    ("The first month of the year is", ["January", "March", "July", "October"], 0),
    ("People read books in a", ["library", "garage", "stadium", "kitchen"], 0),
]
GEN_ITEMS = [
    ("What is the capital of France? Answer in one word.", "Paris"),
    ("What is 2 + 3? Answer with a number.", "5"),
    ("Name a primary color.", "Red"),
    ("What animal says meow?", "A cat"),
]


def _write_tasks(folder) -> None:
    """Two lm-eval tasks over local JSONL files (the `json` builder ships inside `datasets`)."""
    mc, gen = folder / "mc.jsonl", folder / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC_ITEMS))
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN_ITEMS))
    (folder / "batchgen_mc.yaml").write_text(f"""task: batchgen_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (folder / "batchgen_gen.yaml").write_text(f"""task: batchgen_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("serve") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(server_process, hf_model):
    return server_process.wait_ready()


@pytest.fixture(scope="module")
def lm_eval_run(tmp_path_factory):
    """lm_eval imported with its datasets offline and cached under a temporary folder, and a runner
    of `simple_evaluate` over the two local tasks."""
    folder = tmp_path_factory.mktemp("lm_eval")
    _write_tasks(folder)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")  # the tasks' files are local: nothing is downloaded
        env.setenv("HF_DATASETS_CACHE", str(folder / "datasets"))
        import lm_eval
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=str(folder))

        def run(model, task: str, **kwargs) -> list[dict]:
            results = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager, log_samples=True,
                                              **kwargs)
            return sorted(results["samples"][task], key=lambda s: s["doc_id"])
        yield run


@pytest.fixture(scope="module")
def hf_lm(hf_model, hf_tokenizer):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=8)


def test_multiple_choice_through_local_completions_equals_the_hf_backend(server, lm_eval_run, hf_lm):
    args = {"base_url": f"{server.base_url}/v1/completions", "model": MODEL, "max_retries": 1, "batch_size": 16}
    ours = lm_eval_run("local-completions", "batchgen_mc", model_args=args)
    reference = lm_eval_run(hf_lm, "batchgen_mc")
    assert len(ours) == len(reference) == len(MC_ITEMS)
    for a, b in zip(ours, reference):
        our_ll = [r[0] for r in a["filtered_resps"]]
        hf_ll = [r[0] for r in b["filtered_resps"]]
        assert max(range(4), key=our_ll.__getitem__) == max(range(4), key=hf_ll.__getitem__), a["doc"]
        assert our_ll == pytest.approx(hf_ll, abs=1e-3)
        assert [r[1] for r in a["filtered_resps"]] == [r[1] for r in b["filtered_resps"]]  # is_greedy
        assert a["acc"] == b["acc"]


def test_generate_until_through_local_chat_completions_equals_the_hf_backend(server, lm_eval_run, hf_lm):
    args = {"base_url": f"{server.base_url}/v1/chat/completions", "model": MODEL, "max_retries": 1}
    ours = lm_eval_run("local-chat-completions", "batchgen_gen", model_args=args, apply_chat_template=True)
    reference = lm_eval_run(hf_lm, "batchgen_gen", apply_chat_template=True)
    assert [s["filtered_resps"] for s in ours] == [s["filtered_resps"] for s in reference]
    assert any(s["filtered_resps"][0].strip() for s in ours)  # it generated something
    assert [s["exact_match"] for s in ours] == [s["exact_match"] for s in reference]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_echo_with_max_tokens_0_gives_the_prompt_log_probabilities_of_hf(server, hf_model, hf_tokenizer):
    prompts = ["The capital of France is Paris.", "One, two, three, four, five"]
    ids = [hf_tokenizer.encode(p) for p in prompts]
    reply = _post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True,
                                              "logprobs": 2, "temperature": 0}).json()
    for prompt, choice, token_ids in zip(prompts, reply["choices"], ids):
        with torch.no_grad():
            log_softmax = torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=-1)
        expected = log_softmax[:-1].gather(-1, torch.tensor(token_ids[1:])[:, None]).squeeze(-1)
        logprobs = choice["logprobs"]
        assert choice["text"] == prompt and len(logprobs["tokens"]) == len(token_ids)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected.tolist(), abs=1e-4)
        for position, top in enumerate(logprobs["top_logprobs"][1:], start=1):
            best = log_softmax[position - 1].max().item()
            assert max(top.values()) == pytest.approx(best, abs=1e-4) and len(top) <= 3
        ranks = [entry[str(t)]["rank"] for entry, t in zip(choice["prompt_logprobs"][1:], token_ids[1:])]
        assert ranks == [int((row > row[t]).sum()) + 1 for row, t in zip(log_softmax[:-1], token_ids[1:])]


def test_beam_search_through_the_server_equals_llm_beam_search(server, llm):
    prompt = "Translate to French: good morning"
    reply = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 10, "n": 3,
                                              "use_beam_search": True}).json()
    expected = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10))[0].sequences
    assert [c["text"] for c in reply["choices"]] == [s.text for s in expected]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]


@pytest.mark.parametrize("body, field, words", [
    ({"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature", "must be 0 with beam search"),
    ({"use_beam_search": True, "n": 2, "stream": True}, "stream", "not available with use_beam_search"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "must be None or in [0, 20]"),
    ({"echo": True, "logprobs": 21}, "logprobs", "must be None"),
    ({"max_tokens": 0}, "max_tokens", "0 only with echo"),
    ({"echo": True, "stream": True}, "stream", "not available with echo"),
    ({"length_penalty": 2.0}, "length_penalty", "beam search only"),
])
def test_impossible_combinations_are_400_naming_the_field(server, body, field, words):
    reply = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and words in error["message"]


def test_tokenizer_endpoints_answer_as_vllms(server, hf_tokenizer):
    text = "Hello world, how are you?"
    tokens = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert tokens == hf_tokenizer.encode(text, add_special_tokens=False)
    assert _post(server, "/detokenize", {"tokens": tokens}).json() == {"prompt": text}
    info = httpx.get(f"{server.base_url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == hf_tokenizer.eos_token and info["chat_template"]


def test_tokenize_renders_messages_as_a_chat_completion_does(server, hf_tokenizer):
    messages = [{"role": "user", "content": "Say <|im_end|> twice."}]  # control-token text stays text
    tokens = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert len(tokens) == chat["usage"]["prompt_tokens"]
    assert tokens.count(hf_tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2  # the template's two turn ends
    bare = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert tokens[:len(bare)] == bare and len(bare) < len(tokens)


def test_chat_prompt_logprobs_are_the_engines(server, llm):
    messages = [{"role": "user", "content": "Say hello."}]
    reply = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                   "temperature": 0, "prompt_logprobs": 1}).json()
    expected = llm.generate([messages], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    got = reply["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected.prompt_token_ids)
    for position, want in zip(got[1:], expected.prompt_logprobs[1:]):
        assert {int(t): entry["rank"] for t, entry in position.items()} == {t: lp.rank for t, lp in want.items()}
        assert [e["logprob"] for e in position.values()] == pytest.approx([lp.logprob for lp in want.values()],
                                                                          abs=1e-4)

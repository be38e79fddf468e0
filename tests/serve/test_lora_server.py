"""`batchgen serve --enable-lora --lora-modules A=... B=...`: the openai client's `model: "A"` / `"B"` runs
that adapter (peft's greedy outputs), `/v1/models` lists the base and its adapters as vLLM does (parent:
the base), and lm-eval's `local-completions` with model=A scores a multiple-choice task as lm-eval's `hf`
backend with peft=<A's folder>."""

from __future__ import annotations

import pytest

from tests.engine.lora.conftest import PROMPTS
from tests.lora_adapters import peft_greedy
from tests.serve.server_process import ServerProcess
from tests.serve.test_lm_eval import MC_ITEMS, _write_tasks

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

NUM_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_hf_folder, lora_adapters):
    _, folders = lora_adapters
    server = ServerProcess(tmp_path_factory.mktemp("serve-lora") / "server.log", "--served-model-name", "base",
                           "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
                           "--lora-modules", f"A={folders['A']}", f"B={folders['B']}", model=str(smollm_hf_folder))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_lists_the_base_and_its_adapters(client, lora_adapters):
    _, folders = lora_adapters
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "A", "B"}
    assert models["A"].parent == "base" and models["A"].root == str(folders["A"])
    assert models["base"].parent is None


def test_model_selects_the_adapter(client, lora_adapters, hf_tokenizer):
    peft_model, _ = lora_adapters
    texts = [hf_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in PROMPTS[:3]]
    ids = [hf_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for model in ("A", "B", "base"):
        reply = client.completions.create(model=model, prompt=ids, max_tokens=NUM_TOKENS, temperature=0)
        expected = peft_greedy(peft_model, None if model == "base" else model, ids, NUM_TOKENS,
                               (hf_tokenizer.eos_token_id,), hf_tokenizer.pad_token_id)
        texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
        assert texts == [hf_tokenizer.decode(t, skip_special_tokens=True) for t in expected], model


def test_unknown_model_is_404_or_400(client):
    from openai import BadRequestError, NotFoundError

    with pytest.raises((BadRequestError, NotFoundError), match="not served here"):
        client.completions.create(model="C", prompt="Hi", max_tokens=2)


def test_lm_eval_local_completions_on_adapter_equals_hf_backend_with_peft(server, lora_adapters, smollm_hf_folder,
                                                                         tmp_path_factory):
    _, folders = lora_adapters
    folder = tmp_path_factory.mktemp("lm_eval_lora")
    _write_tasks(folder)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_DATASETS_CACHE", str(folder / "datasets"))
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=str(folder))

        def run(model, **kwargs):
            results = lm_eval.simple_evaluate(model=model, tasks=["batchgen_mc"], task_manager=manager,
                                              log_samples=True, **kwargs)
            return sorted(results["samples"]["batchgen_mc"], key=lambda s: s["doc_id"])
        args = {"base_url": f"{server.base_url}/v1/completions", "model": "A", "max_retries": 1, "batch_size": 16,
                "tokenizer": str(smollm_hf_folder)}
        ours = run("local-completions", model_args=args)
        hf = HFLM(pretrained=str(smollm_hf_folder), peft=str(folders["A"]), dtype="float32", batch_size=8,
                  device="cpu")
        reference = run(hf)
    assert len(ours) == len(reference) == len(MC_ITEMS)
    for a, b in zip(ours, reference):
        assert [r[0] for r in a["filtered_resps"]] == pytest.approx([r[0] for r in b["filtered_resps"]], abs=1e-3)
        assert a["acc"] == b["acc"]

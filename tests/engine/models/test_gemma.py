"""Gemma 2 (Gemma2ForCausalLM) and Gemma 3's text model (Gemma3ForCausalLM) against transformers' classes
on tiny random-weight models, with sliding windows far shorter than the prompts.

Each model is written by transformers (seeded, float32, eager attention, `save_pretrained` beside the
bundled tokenizer) with every weight drawn at random, Gemma's norm weights (scale 1 + w) included, so
a norm read without its offset changes the logits. Gemma 2: local and global layers alternating with
a 12-token window, soft-caps of 5 (attention) and 3 (final logits) that the random weights push well
into the tanh's bend, query_pre_attn_scalar 24 (not head_dim). Gemma 3: two local layers (window 12,
rope base 10,000) to one global (rope base 1,000,000 with linear scaling x 2), q/k norms.

Shown for each: greedy 32-token continuations of 8 prompts (5 to 130 tokens) equal HF `generate`, alone
and in a batch with chunked prefill, a preemption and a warm prefix cache, on the C kernels, on SDPA
with the eager ops, over two tensor-parallel ranks (gloo), and (fewer prompts, under the Triton
interpreter) on the Triton kernels; prompt log-probabilities within 1e-4 of HF's float32 log-softmax.
"""

from __future__ import annotations

import json

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.models.config import ModelConfig
from batchgen.kernels import cpu_elementwise, cpu_paged_attention
from tests.engine.helpers import hf_greedy, run_requests
from tests.engine.models.test_registry import randomize_weights

WINDOW = 12
NUM_TOKENS = 32
NUM_BLOCKS = 24  # 384 tokens of KV: less than the batch needs at once, so the scheduler preempts
ENGINE = dict(dtype="float32", device="cpu", max_model_len=NUM_BLOCKS * 16, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=WINDOW,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
FAMILIES = {
    "Gemma2ForCausalLM": dict(num_hidden_layers=2, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "Gemma3ForCausalLM": dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention",
                                                                "full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 1000000.0}}),
}


def hf_config(architecture: str, vocab_size: int, **keys):
    import transformers

    name = "Gemma2Config" if architecture.startswith("Gemma2") else "Gemma3TextConfig"
    config = getattr(transformers, name)(vocab_size=vocab_size, **{**SHAPE, **FAMILIES[architecture], **keys})
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module", params=list(FAMILIES))
def gemma(request, hf_tokenizer, tmp_path_factory):
    """(architecture, HF model, its saved folder)."""
    import transformers

    architecture = request.param
    torch.manual_seed(0)
    hf = randomize_weights(getattr(transformers, architecture)(hf_config(architecture, len(hf_tokenizer))))
    with torch.no_grad():  # Gemma's norm weights are offsets from 1: draw them around 0, off their init
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    hf = hf.float().eval()
    folder = tmp_path_factory.mktemp(architecture)
    hf.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return architecture, hf, folder


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    """Eight prompts of 5 to 130 tokens (most longer than the window); three share a 48-token prefix."""
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, len(hf_tokenizer), (n,), generator=gen).tolist()

    prefix = tokens(48)
    return [tokens(5), tokens(16), tokens(17), prefix + tokens(3), prefix + tokens(30), tokens(70),
            prefix + tokens(60), tokens(130)]


@pytest.fixture(scope="module")
def hf_tokens(gemma, prompts) -> list[list[int]]:
    _, hf, _ = gemma
    return hf_greedy(hf, prompts, NUM_TOKENS, eos_token_ids=(2,), pad_token_id=0)


def greedy_batch(llm: LLM, prompts: list[list[int]], tag: str) -> dict[str, object]:
    return run_requests(llm.engine, {f"{tag}-{i}": (ids, GREEDY) for i, ids in enumerate(prompts)})


def assert_tokens(outputs: dict, tag: str, hf_tokens: list[list[int]], indices) -> None:
    for i in indices:
        assert outputs[f"{tag}-{i}"].outputs[0].token_ids == hf_tokens[i], f"{tag} prompt {i}"


def test_the_config_turns_gemmas_differences_on(gemma):
    architecture, _, folder = gemma
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    assert (cfg.architecture, cfg.sandwich_norms, cfg.hidden_act, cfg.attention_scale) == (
        architecture, True, "gelu_pytorch_tanh", 24 ** -0.5)
    windows = [cfg.layer_sliding_window(i) for i in range(cfg.num_layers)]
    if architecture == "Gemma2ForCausalLM":
        assert windows == [WINDOW, None]
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.qk_norm) == (5.0, 3.0, False)
    else:
        assert windows == [WINDOW, WINDOW, None]
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.qk_norm) == (None, None, True)
        assert (cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling["factor"]) == (10000.0, 1e6, 2.0)
    # transformers' defaults where config.json says nothing: tied embeddings; Gemma 2 alternates from
    # layer 0 with softcaps 50 / 30; Gemma 3 has five local layers to one global.
    bare = {"architectures": [architecture], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_hidden_layers": 6}
    default = ModelConfig.from_hf_dict(bare)
    assert default.tie_word_embeddings and default.sliding_window == 4096 and default.query_pre_attn_scalar == 256
    if architecture == "Gemma2ForCausalLM":
        assert default.layer_types == ("sliding_attention", "full_attention") * 3
        assert (default.attn_logit_softcapping, default.final_logit_softcapping) == (50.0, 30.0)
    else:
        assert default.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
        old = ModelConfig.from_hf_dict({**bare, "sliding_window_pattern": 3, "rope_theta": 5e5,
                                        "rope_local_base_freq": 2e4, "rope_scaling": {"rope_type": "linear",
                                                                                      "factor": 8.0}})
        assert old.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
        assert (old.rope_theta, old.rope_local_theta, old.rope_scaling["factor"]) == (5e5, 2e4, 8.0)


@torch.no_grad()
def test_the_window_and_the_soft_caps_engage_in_this_model(gemma, prompts):
    """HF's own class gives other logits without its window (and, Gemma 2, without each soft-cap): the
    prompts are long enough and the scores large enough for every one of them to matter."""
    architecture, hf, _ = gemma
    ids = torch.tensor([prompts[5]])
    reference = hf(ids).logits
    hf.config.sliding_window = 4096
    try:
        assert (hf(ids).logits - reference).abs().max() > 0.05
    finally:
        hf.config.sliding_window = WINDOW
    if architecture != "Gemma2ForCausalLM":
        return
    assert reference.abs().max() < 3.0
    attentions = [layer.self_attn for layer in hf.model.layers]
    hf.config.final_logit_softcapping = None
    try:
        assert hf(ids).logits.abs().max() > 6.0  # final logits well past the cap of 3
        for attention in attentions:
            attention.attn_logit_softcapping = None
        uncapped_attention = hf(ids).logits
    finally:
        hf.config.final_logit_softcapping = 3.0
        for attention in attentions:
            attention.attn_logit_softcapping = 5.0
    assert (torch.tanh(uncapped_attention / 3.0) * 3.0 - reference).abs().max() > 0.05  # the attention cap bends


@torch.no_grad()
def test_greedy_equals_hf_alone_batched_chunked_preempted_and_prefix_cached(gemma, prompts, hf_tokens):
    _, _, folder = gemma
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, **ENGINE)
    engine = llm.engine
    assert engine.capabilities.attention_backend == "cpu" and engine.capabilities.elementwise_ops == "c"
    assert engine.weight_bytes == weight_bytes(engine.model_cfg, torch.float32)  # the four norms per layer
    for i in (0, 7):  # alone
        out = greedy_batch(llm, [prompts[i]], f"alone{i}")[f"alone{i}-0"]
        assert out.outputs[0].token_ids == hf_tokens[i], f"prompt {i} alone"
    for run in ("cold", "warm"):  # the second run finds the prompts' blocks in the prefix cache
        before = dict(engine.stats)
        outputs = greedy_batch(llm, prompts, run)
        assert_tokens(outputs, run, hf_tokens, range(len(prompts)))
        stats = engine.stats
        assert stats["num_partial_prefills"] > before["num_partial_prefills"]
        if run == "cold":
            assert stats["num_preemptions"] > before["num_preemptions"]
    assert sum(outputs[f"warm-{i}"].num_cached_tokens for i in range(len(prompts))) >= 3 * 48


@torch.no_grad()
def test_sdpa_with_eager_ops_equals_hf(gemma, prompts, hf_tokens, monkeypatch):
    _, _, folder = gemma
    monkeypatch.setattr(cpu_paged_attention, "is_available", lambda: False)
    monkeypatch.setattr(cpu_elementwise, "is_available", lambda: False)
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, **ENGINE)
    capabilities = llm.engine.capabilities
    assert capabilities.attention_backend == "sdpa" and capabilities.elementwise_ops == "eager"
    for run in ("cold", "warm"):  # staged decodes, fresh prompts, chunks over cached prefixes
        assert_tokens(greedy_batch(llm, prompts, run), run, hf_tokens, range(len(prompts)))


@pytest.mark.triton
@torch.no_grad()
def test_triton_kernels_equal_hf(gemma, prompts, hf_tokens):
    """Under the interpreter (8 tokens, to keep it cheap): a 17-token prompt prefilled in chunks beside
    a 70-token one's, then both decoding."""
    _, _, folder = gemma
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, attention_backend="triton",
              **{**ENGINE, "max_num_batched_tokens": 16})
    assert llm.engine.capabilities.attention_backend == "triton"
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = run_requests(llm.engine, {i: (prompts[i], params) for i in (2, 5)})
    for i in (2, 5):
        assert outputs[i].outputs[0].token_ids == hf_tokens[i][:8], f"prompt {i}"


@torch.no_grad()
def test_prompt_logprobs_are_hfs_log_softmax(gemma, prompts):
    _, hf, folder = gemma
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, **ENGINE)  # 32-token chunks: split prefills
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = run_requests(llm.engine, {f"lp-{i}": (prompts[i], params) for i in (4, 7)})
    for i in (4, 7):
        ids = prompts[i]
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        expected = expected.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        positions = outputs[f"lp-{i}"].prompt_logprobs
        ours = torch.tensor([position[t].logprob for position, t in zip(positions[1:], ids[1:])])
        assert (ours - expected).abs().max().item() <= 1e-4, f"prompt {i}"


@pytest.mark.subprocess
@torch.no_grad()
def test_two_ranks_over_gloo_equal_hf(gemma, prompts, hf_tokens):
    """Tensor parallelism: each rank holds half the query heads, one of the two KV heads and half the MLP
    (Gemma 3's per-head q/k norms whole), its backend the model's windows, soft-cap and scale; the
    final soft-cap is applied once to the whole logits. Tokens equal HF's, batched, chunked, preempted."""
    _, _, folder = gemma
    threads = torch.get_num_threads()
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, tensor_parallel_size=2, **ENGINE)
    try:
        model = llm.engine.runner.model
        assert model.layers[0].self_attn.qkv_proj.weight.shape == (2 * 16 + 2 * 16, 64)  # 2 query heads, 1 KV head
        assert model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 64, 64)
        assert model.backend.scale == 24 ** -0.5
        cfg = llm.engine.model_cfg
        assert [layer.sliding_window for layer in model.backend.layers] == [
            cfg.layer_sliding_window(i) for i in range(cfg.num_layers)]
        assert WINDOW in [layer.sliding_window for layer in model.backend.layers]
        outputs = greedy_batch(llm, prompts, "tp")
        assert_tokens(outputs, "tp", hf_tokens, range(len(prompts)))
        assert llm.engine.stats["num_preemptions"] > 0 and llm.engine.stats["num_partial_prefills"] > 0
    finally:
        llm.engine.shutdown()
        torch.set_num_threads(threads)

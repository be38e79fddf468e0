"""GLM-4 (Glm4ForCausalLM) against transformers' class on a tiny random-weight model: what sets it apart
from Llama (sandwich norms, q/k/v biases, rope on adjacent pairs of each head's first half, the
checkpoint's fused gate_up_proj) on every engine path.

The model is written by transformers (seeded, float32, eager attention, `save_pretrained` beside the
bundled tokenizer) with head_dim 32, so rope rotates 8 interleaved pairs and leaves 16 dimensions
alone. Greedy continuations equal HF `generate` alone and in a batch of different-length prompts that
share a prefix, with chunked prefill, a pool small enough to preempt and a warm prefix cache, on the C
attention and elementwise kernels and on SDPA with the eager ops; prompt log-probabilities are within
1e-4 of HF's log-softmax. The registry test (test_registry.py) compares its logits on the default shape.
"""

from __future__ import annotations

import json

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.models import ops
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.layers.rotary import RotaryEmbedding
from batchgen.engine.parallel.layout import TensorParallelLayout
from batchgen.kernels import cpu_elementwise, cpu_paged_attention, reference
from tests.engine.helpers import hf_greedy, run_requests
from tests.engine.models.test_registry import hf_config, tiny_hf_model

ARCH = "Glm4ForCausalLM"
HEAD_DIM = 32  # rope: the first 16 dimensions (partial_rotary_factor 0.5), pairs (0, 1) .. (14, 15)
NUM_TOKENS = 32
NUM_BLOCKS = 24  # 384 tokens of KV: less than the batch below needs at once, so the scheduler preempts
ENGINE = dict(dtype="float32", device="cpu", max_model_len=NUM_BLOCKS * 16, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)


@pytest.fixture(scope="module")
def glm4(hf_tokenizer, tmp_path_factory):
    """(HF model, its saved folder)."""
    hf = tiny_hf_model(ARCH, len(hf_tokenizer), head_dim=HEAD_DIM, partial_rotary_factor=0.5,
                       attention_bias=True)
    folder = tmp_path_factory.mktemp("glm4")
    hf.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return hf, folder


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    """Eight prompts of 5 to 130 tokens; three share a 48-token prefix (three full KV blocks)."""
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, len(hf_tokenizer), (n,), generator=gen).tolist()

    prefix = tokens(48)
    return [tokens(5), tokens(16), tokens(17), prefix + tokens(3), prefix + tokens(30), tokens(70),
            prefix + tokens(60), tokens(130)]


@pytest.fixture(scope="module")
def hf_tokens(glm4, prompts) -> list[list[int]]:
    hf, _ = glm4
    return hf_greedy(hf, prompts, NUM_TOKENS, eos_token_ids=(2,), pad_token_id=0)


def greedy_batch(llm: LLM, prompts: list[list[int]], tag: str) -> dict[str, object]:
    return run_requests(llm.engine, {f"{tag}-{i}": (ids, GREEDY) for i, ids in enumerate(prompts)})


def test_the_config_turns_glms_differences_on(glm4):
    _, folder = glm4
    saved = json.loads((folder / "config.json").read_text())
    assert saved["rope_parameters"]["partial_rotary_factor"] == 0.5 and saved["attention_bias"] is True
    cfg = ModelConfig.from_hf_dict(saved)
    facts = (cfg.architecture, cfg.rotary_dim, cfg.rope_interleaved, cfg.sandwich_norms, cfg.attention_bias)
    assert facts == (ARCH, HEAD_DIM // 2, True, True, True)
    # GLM-4-0414's own config.json states the factor at the top level; transformers' Glm4Config takes 0.5
    # (and a q/k/v bias) when it states nothing.
    glm = dict(architectures=[ARCH], model_type="glm4", head_dim=HEAD_DIM)
    top_level = ModelConfig.from_hf_dict(hf_config(**glm, partial_rotary_factor=0.25, attention_bias=False))
    unstated = ModelConfig.from_hf_dict(hf_config(**glm))
    assert (top_level.rotary_dim, top_level.attention_bias) == (8, False)
    assert (unstated.rotary_dim, unstated.attention_bias) == (16, True)
    # Other families rotate whole heads as before.
    assert ModelConfig.from_hf_dict(hf_config()).rotary_dim == ModelConfig.from_hf_dict(hf_config()).head_dim


@torch.no_grad()
def test_interleaved_partial_rotary_is_hfs():
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb

    num_positions = 300
    rotary = RotaryEmbedding(HEAD_DIM // 2, num_positions, 10000.0, None, interleaved=True, head_dim=HEAD_DIM)
    positions = torch.arange(num_positions)
    torch.manual_seed(0)
    q, k = torch.randn(num_positions, 4, HEAD_DIM), torch.randn(num_positions, 2, HEAD_DIM)
    # HF's tables: cos/sin of cat(freqs, freqs) over the rotated width, (1, P, R)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM // 2, 2).float() / (HEAD_DIM // 2)))
    emb = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos(), emb.sin())
    cos, sin = rotary.lookup(positions, torch.float32)
    ours = reference.rotary_interleaved_ref(torch.cat([q, k], dim=1), cos, sin)  # (P, 6, D)
    torch.testing.assert_close(ours[:, :4], hf_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[:, 4:], hf_k[0].transpose(0, 1), rtol=0, atol=1e-6)
    passed = torch.cat([q, k], dim=1)[..., HEAD_DIM // 2:]
    assert torch.equal(ours[..., HEAD_DIM // 2:], passed)  # the dimensions past the rotary width
    # Every op set has it (the C set runs it eager).
    assert ops.cpu_kernel_ops().rotary_interleaved is ops.eager_ops().rotary_interleaved


@torch.no_grad()
def test_greedy_equals_hf_alone_batched_chunked_preempted_and_prefix_cached(glm4, prompts, hf_tokens):
    _, folder = glm4
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, **ENGINE)
    engine = llm.engine
    assert engine.capabilities.attention_backend == "cpu" and engine.capabilities.elementwise_ops == "c"
    assert engine.weight_bytes == weight_bytes(engine.model_cfg, torch.float32)  # the extra norms and biases

    for i in (0, 7):  # alone
        out = greedy_batch(llm, [prompts[i]], f"alone{i}")[f"alone{i}-0"]
        assert out.outputs[0].token_ids == hf_tokens[i], f"prompt {i} alone"
    for run in ("cold", "warm"):  # the second run finds the prompts' blocks in the prefix cache
        before = dict(engine.stats)
        outputs = greedy_batch(llm, prompts, run)
        for i in range(len(prompts)):
            assert outputs[f"{run}-{i}"].outputs[0].token_ids == hf_tokens[i], f"{run} prompt {i}"
        stats = engine.stats
        assert stats["num_partial_prefills"] > before["num_partial_prefills"]
        if run == "cold":
            assert stats["num_preemptions"] > before["num_preemptions"]
    assert sum(outputs[f"warm-{i}"].num_cached_tokens for i in range(len(prompts))) >= 3 * 48


@torch.no_grad()
def test_sdpa_with_eager_ops_equals_hf(glm4, prompts, hf_tokens, monkeypatch):
    _, folder = glm4
    monkeypatch.setattr(cpu_paged_attention, "is_available", lambda: False)
    monkeypatch.setattr(cpu_elementwise, "is_available", lambda: False)
    llm = LLM(str(folder), num_kv_blocks=4 * NUM_BLOCKS, **ENGINE)
    capabilities = llm.engine.capabilities
    assert capabilities.attention_backend == "sdpa" and capabilities.elementwise_ops == "eager"
    outputs = greedy_batch(llm, prompts, "sdpa")
    for i in range(len(prompts)):
        assert outputs[f"sdpa-{i}"].outputs[0].token_ids == hf_tokens[i], f"prompt {i}"


@torch.no_grad()
def test_prompt_logprobs_are_hfs_log_softmax(glm4, prompts):
    hf, folder = glm4
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


def test_tensor_parallelism_holds_the_fused_gate_up_checkpoint_tensor_whole_and_cuts_its_rows(glm4):
    """As Phi-3's (tested end to end over gloo there): the checkpoint's gate_up_proj is read whole and each
    rank keeps its gate rows and its up rows (DecoderModel.load_weights, layout.fused_rows)."""
    _, folder = glm4
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    layout = TensorParallelLayout.plan(cfg, 1, 2)
    assert layout.shard("model.layers.0.mlp.down_proj.weight", (64, 128)) is not None
    assert layout.shard("model.layers.0.mlp.gate_up_proj.weight", (256, 64)) is None  # held whole
    half = cfg.intermediate_size // 2
    assert layout.fused_rows("gate_up_proj") == [(half, 2 * half), (3 * half, 4 * half)]


@pytest.mark.subprocess
def test_two_ranks_over_gloo_give_hfs_tokens(glm4, prompts, hf_tokens):
    """Tensor parallelism: each rank reads the checkpoint's fused gate_up_proj whole and keeps its gate and
    up rows; q/k/v (with their biases) split as Llama's; greedy tokens equal HF's."""
    hf, folder = glm4
    threads = torch.get_num_threads()
    llm = LLM(str(folder), num_kv_blocks=64, tensor_parallel_size=2,
              **{**ENGINE, "max_model_len": 256})
    try:
        model = llm.engine.runner.model
        # this rank's half of the gate rows and half of the up rows
        assert model.layers[0].mlp.gate_up_proj.weight.shape[0] == 2 * (hf.config.intermediate_size // 2)
        outputs = greedy_batch(llm, prompts[:6], "tp")
        for i in range(6):
            assert outputs[f"tp-{i}"].outputs[0].token_ids == hf_tokens[i], f"prompt {i}"
    finally:
        llm.engine.shutdown()
        torch.set_num_threads(threads)


def write_glm4_gguf(hf, path):
    """The tiny model as llama.cpp's converter writes a GLM-4 (convert_hf_to_gguf.py's Glm4Model): every
    tensor named by the gguf package's own GLM-4 map (gate_up_proj whole as ffn_up, the norms after attention
    and after the MLP as post_attention_norm / post_ffw_norm, q/k rows as HF's: llama.cpp rotates GLM-4's
    adjacent pairs too), rope.dimension_count = the rotated half of a head; a small tokenizer
    (small_gguf_tokenizer.py) with the model's vocabulary size."""
    import gguf

    from tests.engine.models.gguf_writing import finish_gguf, new_gguf_writer
    from tests.engine.models.small_gguf_tokenizer import add_small_tokenizer

    cfg = hf.config
    writer = new_gguf_writer(path, "glm4", cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(int(cfg.head_dim * 0.5))
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    add_small_tokenizer(writer, cfg.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4, cfg.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    finish_gguf(writer)
    return path


@torch.no_grad()
def test_a_gguf_written_by_the_gguf_package_matches_its_safetensors_twin(glm4, prompts, hf_tokens, tmp_path):
    """The GGUF's config equals the folder's field by field; its greedy tokens equal HF's and every sampled
    row's logits the folder's."""
    from batchgen.engine.loader.gguf_loader import read_gguf_config
    from tests.engine.helpers import captured_logits, relative_error

    hf, folder = glm4
    path = write_glm4_gguf(hf, tmp_path / "glm4.gguf")
    gguf_cfg = read_gguf_config(path)
    folder_cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    for key in ("architecture", "sandwich_norms", "rope_interleaved", "rotary_dim", "attention_bias", "head_dim",
                "num_heads", "num_kv_heads", "intermediate_size", "vocab_size", "rope_theta",
                "tie_word_embeddings", "hidden_act", "qk_norm"):
        assert getattr(gguf_cfg, key) == getattr(folder_cfg, key), key
    assert gguf_cfg.rms_norm_eps == pytest.approx(folder_cfg.rms_norm_eps, rel=1e-7)  # a float32 in the file
    requests = {i: (prompts[i], GREEDY) for i in (2, 5, 7)}
    results = []
    for source in (folder, path):
        llm = LLM(str(source), num_kv_blocks=NUM_BLOCKS, **ENGINE)
        with captured_logits(llm.engine) as records:
            outputs = run_requests(llm.engine, requests)
        results.append(({i: outputs[i].outputs[0].token_ids for i in requests}, records))
    # The tokenizer is the file's (transformers builds it from the keys; it reads no glm4 config).
    assert llm.get_tokenizer().convert_ids_to_tokens([261, 2]) == ["Ġthe", "</s>"]
    (folder_tokens, folder_logits), (gguf_tokens, gguf_logits) = results
    assert gguf_tokens == folder_tokens == {i: hf_tokens[i] for i in requests}
    for key, logits in folder_logits.items():
        assert relative_error(gguf_logits[key], logits) <= 1e-5, key

"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers' own class: pre-fused qkv_proj and gate_up_proj,
partial rotary (0.75, as Phi-4-mini) and LongRoPE in both of its regimes.

One tiny model (seeded random weights, float32, eager attention, saved by transformers with the bundled
tokenizer's vocabulary): head_dim 16 of which rope turns 12, LongRoPE with original_max_position_embeddings
32 and max_position_embeddings 128. HF's class picks the short or long factors per forward by the sequence's
length, the engine once by max_model_len (long when it exceeds 32): the comparisons run where the two agree,
max_model_len 32 with every sequence within 32 tokens (short) and max_model_len 128 with every prompt longer
than 32 tokens (long).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.layers.rotary import rope_attention_factor, rope_inv_freq
from batchgen.engine.models.ops import eager_ops
from tests.engine.helpers import captured_logits, relative_error, run_requests
from tests.engine.models.test_registry import randomize_weights

LOGITS_TOLERANCE = 1e-3
ORIGINAL_MAX = 32
NUM_TOKENS = 8
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-6}
# Six frequencies (rotary width 12): short factors near 1, long ones stretching the low frequencies.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]}
SHORT_PROMPT_LENGTHS = (5, 13, 24)  # + 8 new tokens stay within 32: HF's short factors throughout
LONG_PROMPT_LENGTHS = (33, 47, 70)  # longer than 32 from the first forward: HF's long factors throughout
SHARED_PREFIX = 48  # three full blocks two prompts share (the prefix cache)
WINDOW = 20  # a sliding window below every long prompt


def phi3_config(vocab_size: int, **keys):
    from transformers import Phi3Config

    config = Phi3Config(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        max_position_embeddings=128, original_max_position_embeddings=ORIGINAL_MAX,
                        partial_rotary_factor=0.75, rope_scaling=dict(LONGROPE), **SHAPE, **keys)
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def phi3(hf_tokenizer, tmp_path_factory):
    """(HF model, its saved folder)."""
    from transformers import Phi3ForCausalLM

    torch.manual_seed(0)
    model = randomize_weights(Phi3ForCausalLM(phi3_config(len(hf_tokenizer))).float().eval())
    folder = tmp_path_factory.mktemp("phi3")
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return model, folder


def prompts_of(lengths: tuple[int, ...], vocab_size: int, seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{n}": torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths}


@torch.no_grad()
def hf_reference(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """(HF generate's greedy tokens, HF's logits (NUM_TOKENS, V) at the rows that sampled them)."""
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                      pad_token_id=0)[0, len(prompt):].tolist()
    logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    return out, logits


def assert_matches_hf(hf, llm: LLM, prompts: dict[str, list[int]], references: dict | None = None) -> dict:
    """Every prompt through the engine in one batch: greedy tokens equal HF generate's, every sampled
    row's logits within 1e-3 of HF's. Returns the outputs."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with captured_logits(llm.engine) as records:
        outputs = run_requests(llm.engine, {rid: (ids, params) for rid, ids in prompts.items()})
    for rid, prompt in prompts.items():
        tokens, logits = (references or {}).get(rid) or hf_reference(hf, prompt)
        assert outputs[rid].outputs[0].token_ids == tokens, rid
        for j in range(NUM_TOKENS):
            error = relative_error(records[(rid, 0, j)], logits[j])
            assert error <= LOGITS_TOLERANCE, f"{rid} position {j}: {error:.2e}"
    return outputs


# ---- the config as HF reads it ----------------------------------------------------------------------

PHI3_MINI_128K = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 256, **SHAPE,
                  "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                  "rope_theta": 10000.0, "sliding_window": 262144,
                  "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                   "long_factor": [1.5 + i for i in range(8)]}}
PHI4_MINI = {**PHI3_MINI_128K, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(6)],
                              "long_factor": [2.0 + i for i in range(6)]}}


@pytest.mark.parametrize("config_json", [PHI3_MINI_128K, PHI4_MINI], ids=["phi3-mini-128k", "phi4-mini"])
@pytest.mark.parametrize("max_positions", [4096, 131072], ids=["short", "long"])
def test_longrope_frequencies_and_scale_equal_hf_in_each_regime(config_json, max_positions):
    """The published configs' shape (rope_scaling `type` longrope, the original context at the top
    level, partial_rotary_factor there too): HF's _compute_longrope_parameters at a sequence length in
    each regime equals what the engine computes for that max_model_len."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = Phi3Config.from_dict(json.loads(json.dumps(config_json)))
    seq_len = max_positions if max_positions > 4096 else None  # HF: long once the sequence passes 4096
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=seq_len)
    cfg = ModelConfig.from_hf_dict(config_json)
    assert cfg.rotary_dim == int(16 * config_json.get("partial_rotary_factor", 1.0))
    assert cfg.sliding_window == 262144
    inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
    assert torch.equal(inv_freq, hf_inv_freq)
    assert rope_attention_factor(cfg.rope_scaling) == hf_scale == math.sqrt(1 + math.log(32) / math.log(4096))


@pytest.fixture(scope="module")
def windowed_phi3(phi3, tmp_path_factory):
    """(HF model with sliding_window 20, its saved folder): the same weights, every layer masked to the
    last 20 positions (shorter than every long prompt)."""
    from transformers import Phi3ForCausalLM

    hf, folder = phi3
    windowed = tmp_path_factory.mktemp("phi3-window")
    for file in folder.iterdir():
        if file.name != "config.json":
            (windowed / file.name).symlink_to(file)
    config = json.loads((folder / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    model = Phi3ForCausalLM.from_pretrained(windowed, attn_implementation="eager", dtype=torch.float32).eval()
    return model, windowed


@pytest.fixture(scope="module")
def windowed_references(windowed_phi3, long_prompts) -> dict:
    windowed, _ = windowed_phi3
    return {rid: hf_reference(windowed, prompt) for rid, prompt in long_prompts.items()}


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
@torch.no_grad()
def test_a_sliding_window_masks_as_hf_does_batched_and_chunked(windowed_phi3, long_prompts, long_references,
                                                                 windowed_references, backend):
    """config.json's sliding_window (20, below every long prompt) masks each layer as HF's class does:
    tokens equal HF generate's and logits within 1e-3, 16-token chunks beside decodes, through the C
    kernels and SDPA; and the window changes HF's own greedy tokens, so a window ignored would fail."""
    windowed, folder = windowed_phi3
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=48,
              max_num_batched_tokens=16, attention_backend=backend)
    assert llm.engine.model_cfg.sliding_window == WINDOW
    assert llm.engine.capabilities.attention_backend == backend
    assert any(windowed_references[rid][0] != tokens for rid, (tokens, _) in long_references.items())
    assert_matches_hf(windowed, llm, long_prompts, windowed_references)


# ---- the engine against HF ---------------------------------------------------------------------------

@torch.no_grad()
def test_short_regime_partial_rotary_matches_hf(phi3):
    """max_model_len 32 = original_max_position_embeddings: short factors, as HF while sequences stay short."""
    hf, folder = phi3
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=ORIGINAL_MAX, num_kv_blocks=16,
              max_num_batched_tokens=16)
    cfg = llm.engine.model_cfg
    assert (cfg.architecture, cfg.rotary_dim, cfg.head_dim) == ("Phi3ForCausalLM", 12, 16)
    assert llm.engine.runner.model.rotary.cos.shape == (ORIGINAL_MAX, 12)
    assert llm.engine.weight_bytes == weight_bytes(cfg, torch.float32)  # the capacity plan counts what is held
    assert_matches_hf(hf, llm, prompts_of(SHORT_PROMPT_LENGTHS, cfg.vocab_size, seed=1))


@pytest.fixture(scope="module")
def long_prompts(phi3) -> dict[str, list[int]]:
    """Prompts longer than 32 tokens; two of them share a 48-token prefix (three KV blocks)."""
    hf, _ = phi3
    prompts = prompts_of(LONG_PROMPT_LENGTHS, hf.config.vocab_size, seed=2)
    shared = prompts_of((SHARED_PREFIX, 12, 20), hf.config.vocab_size, seed=3)
    prompts["shared-a"] = shared["p48"] + shared["p12"]
    prompts["shared-b"] = shared["p48"] + shared["p20"]
    return prompts


@pytest.fixture(scope="module")
def long_references(phi3, long_prompts) -> dict:
    hf, _ = phi3
    return {rid: hf_reference(hf, prompt) for rid, prompt in long_prompts.items()}


@pytest.mark.parametrize("path", ["cpu", "sdpa", "eager-ops"])
@torch.no_grad()
def test_long_regime_matches_hf_batched_chunked_and_prefix_cached(phi3, long_prompts, long_references, path):
    """max_model_len 128 > 32: long factors, as HF for prompts longer than 32 tokens. A 16-token step
    budget prefills in chunks beside other sequences' decodes; the second shared-prefix prompt, sent
    after the first finished, reads the first's three cached blocks. Through the C attention kernels
    and elementwise ops, SDPA, and the eager torch ops."""
    hf, folder = phi3
    backend = "sdpa" if path == "sdpa" else "cpu"
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=48,
              max_num_batched_tokens=16, attention_backend=backend)
    model = llm.engine.runner.model
    assert llm.engine.capabilities.attention_backend == backend
    if path == "eager-ops":
        model.ops = eager_ops()
    expected_cos = torch.cat([torch.outer(torch.arange(128.0), rope_inv_freq(12, 10000.0, LONGROPE | {
        "original_max_position_embeddings": ORIGINAL_MAX}, 128))] * 2, dim=-1).cos()
    scale = math.sqrt(1 + math.log(128 / ORIGINAL_MAX) / math.log(ORIGINAL_MAX))
    torch.testing.assert_close(model.rotary.cos, expected_cos * scale, rtol=0, atol=0)

    first = {rid: p for rid, p in long_prompts.items() if rid != "shared-b"}
    assert_matches_hf(hf, llm, first, long_references)
    later = assert_matches_hf(hf, llm, {"shared-b": long_prompts["shared-b"]}, long_references)
    assert later["shared-b"].num_cached_tokens == SHARED_PREFIX


@pytest.mark.subprocess
@torch.no_grad()
def test_two_ranks_over_gloo_give_one_process_tokens(phi3, long_prompts, long_references):
    """Tensor parallelism: each rank reads the checkpoint's fused qkv_proj and gate_up_proj whole and keeps
    its own q, k, v and gate, up rows; tokens equal HF's (and one process's), logits within 1e-4 of HF's."""
    hf, folder = phi3
    threads = torch.get_num_threads()
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=48,
              max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        model = llm.engine.runner.model
        assert model.layers[0].self_attn.qkv_proj.weight.shape == (2 * 16 + 2 * 16, 64)  # 2 query heads, 1 KV head
        assert model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 64, 64)
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        with captured_logits(llm.engine) as records:
            outputs = run_requests(llm.engine, {rid: (ids, params) for rid, ids in long_prompts.items()})
        for rid, (tokens, logits) in long_references.items():
            assert outputs[rid].outputs[0].token_ids == tokens, rid
            for j in range(NUM_TOKENS):
                assert relative_error(records[(rid, 0, j)], logits[j]) <= 1e-4, (rid, j)
    finally:
        llm.engine.shutdown()
        torch.set_num_threads(threads)


# ---- GGUF (llama.cpp's phi3) ----------------------------------------------------------------------------

def write_phi3_gguf(hf, path, tensor_type=None):
    """The tiny model as llama.cpp's converter writes a Phi-3 (convert_hf_to_gguf.py's Phi3MiniModel): fused
    attn_qkv and ffn_up (gate then up rows), rope.dimension_count the rotary width, LongRoPE's factors as
    two float32 tensors; a small tokenizer (small_gguf_tokenizer.py) with the model's vocabulary size.
    `tensor_type`: quantize the 2-D weights to it."""
    import gguf
    import numpy as np

    from tests.engine.models.gguf_writing import finish_gguf, new_gguf_writer
    from tests.engine.models.small_gguf_tokenizer import add_small_tokenizer

    cfg, scaling = hf.config, hf.config.rope_parameters
    writer = new_gguf_writer(path, "phi3", cfg)
    writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    rope_dims = int(scaling["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads  # llama.cpp's
    writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_freq_base(scaling["rope_theta"])
    writer.add_sliding_window(0)
    original = scaling["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    add_small_tokenizer(writer, cfg.vocab_size)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in hf.state_dict().items():
        name = name.removeprefix("model.").removesuffix(".weight")
        if name == "lm_head":
            gguf_name = "output"
        elif name.startswith("layers."):
            _, layer, rest = name.split(".", 2)
            gguf_name = f"blk.{layer}.{names[rest]}"
        else:
            gguf_name = names[name]
        array = tensor.float().numpy()
        if tensor_type is not None and array.ndim == 2 and gguf_name != "token_embd":
            writer.add_tensor(f"{gguf_name}.weight", gguf.quants.quantize(array, tensor_type), raw_dtype=tensor_type)
        else:
            writer.add_tensor(f"{gguf_name}.weight", array)
    writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))
    finish_gguf(writer)
    return path


@torch.no_grad()
def test_a_gguf_written_by_the_gguf_package_matches_hf(phi3, long_prompts, long_references, tmp_path):
    from batchgen.engine.loader.gguf_loader import read_gguf_config

    hf, folder = phi3
    path = write_phi3_gguf(hf, tmp_path / "phi3.gguf")
    cfg = read_gguf_config(path)
    folder_cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    assert (cfg.architecture, cfg.head_dim, cfg.rotary_dim, cfg.sliding_window) == ("Phi3ForCausalLM", 16, 12, None)
    for key in ("long_factor", "short_factor", "original_max_position_embeddings", "factor"):
        assert cfg.rope_scaling[key] == pytest.approx(folder_cfg.rope_scaling[key], rel=1e-6), key
    assert rope_attention_factor(cfg.rope_scaling) == pytest.approx(rope_attention_factor(folder_cfg.rope_scaling))
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=48, max_num_batched_tokens=16)
    assert_matches_hf(hf, llm, long_prompts, long_references)


@torch.no_grad()
def test_a_q8_0_gguf_keeps_its_fused_blocks_and_matches_hf_on_the_same_weights(phi3, long_prompts, tmp_path):
    """quantization gguf: the fused attn_qkv and ffn_up stay Q8_0 blocks in qkv_proj and gate_up_proj; HF's
    class holding the blocks' dequantized values is the reference."""
    import copy

    import gguf

    from batchgen.engine.quant.int_linear import IntLinear

    hf, _ = phi3
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    path = write_phi3_gguf(hf, tmp_path / "phi3-q8_0.gguf", q8_0)
    twin = copy.deepcopy(hf)
    for name, param in twin.named_parameters():
        if param.dim() == 2 and "embed_tokens" not in name:
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), q8_0), q8_0)))
    llm = LLM(str(path), quantization="gguf", dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=48,
              max_num_batched_tokens=16)
    layer = llm.engine.runner.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj, IntLinear) and isinstance(layer.mlp.gate_up_proj, IntLinear)
    assert_matches_hf(twin, llm, long_prompts)

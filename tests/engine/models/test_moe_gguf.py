"""Mixture-of-experts GGUF files (llama.cpp's layout) against HF transformers on the same weights.

Tiny random Mixtral, Qwen3-MoE and Qwen2-MoE (every layer sparse: llama.cpp's MoE architectures have no
dense layers; Qwen3-MoE with norm_topk_prob, Qwen2-MoE without, as llama.cpp renormalises for qwen3moe and
not for qwen2moe; Qwen2-MoE's shared expert and q/k/v biases) written with the `gguf` package as llama.cpp's
converter writes them (convert_hf_to_gguf.py): Mixtral as a "llama" file with expert_count (q/k rows in
its interleaved rope order), Qwen3-MoE as "qwen3moe" with expert_feed_forward_length; the router as
`ffn_gate_inp`, each projection's experts stacked in one `ffn_*_exps` tensor (E, out, in), or (older
Mixtral files) one `ffn_gate.E` tensor per expert; the bundled GGUF's tokenizer keys. Shown: prompt
log-probabilities within 1e-4 of HF's float32 log-softmax and greedy tokens equal to HF's, with F32
experts, with Q8_0 experts (HF given the dequantized values), and with `quantization: gguf` keeping a
Mixtral's Q8_0 attention blocks; tp=2 over gloo equals one process.
"""

from __future__ import annotations

import functools

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.loader.gguf_loader import read_gguf_config
from tests.engine.helpers import run_requests
from tests.engine.models.test_moe import ATTENTION
from tests.engine.models.test_registry import randomize_weights

FAMILIES = {
    "MixtralForCausalLM": dict(intermediate_size=48, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "Qwen3MoeForCausalLM": dict(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_experts=16,
                                num_experts_per_tok=4, norm_topk_prob=True, head_dim=16,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "Qwen2MoeForCausalLM": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                num_hidden_layers=2, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
GGUF_ARCH = {"MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe"}
SETTINGS = dict(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="64MiB")
NUM_TOKENS = 16


def build_hf(architecture: str, hf_tokenizer, **keys):
    import transformers

    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(vocab_size=len(hf_tokenizer), **ATTENTION, **{**FAMILIES[architecture], **keys})
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    return randomize_weights(getattr(transformers, architecture)(config).float().eval())


def llama_cpp_permute(weights, num_heads: int):
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half q/k rows -> llama.cpp's interleaved order."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@functools.lru_cache(maxsize=1)
def tokenizer_fields(smollm_path: str) -> dict:
    """The bundled GGUF's tokenizer keys: {key: (value type, contents)} (parsed once: seconds)."""
    import gguf

    reader = gguf.GGUFReader(smollm_path)
    return {key: (value.types[0], value.contents()) for key, value in reader.fields.items()
            if key.startswith("tokenizer.")}


def write_moe_gguf(hf, architecture: str, path, smollm_path, *, is_per_expert: bool = False, expert_type=None,
                   attention_type=None):
    """The model as llama.cpp's converter writes it (see the module docstring). `is_per_expert`: one tensor per
    expert (older Mixtral files); `expert_type` / `attention_type`: quantize the stacked expert tensors / the
    attention projections to that GGML type."""
    import gguf
    import numpy as np

    from tests.engine.models.gguf_writing import finish_gguf, new_gguf_writer

    cfg, arch = hf.config, GGUF_ARCH[architecture]
    writer = new_gguf_writer(path, arch, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for key, (kind, contents) in tokenizer_fields(str(smollm_path)).items():
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, contents)
        else:
            writer.add_key_value(key, contents, kind)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    for name, tensor in hf.state_dict().items():
        array = tensor.float().numpy()
        name = name.removeprefix("model.")
        kind = "bias" if name.endswith(".bias") else "weight"
        name = name.removesuffix(".weight").removesuffix(".bias")
        if name == "lm_head":
            writer.add_tensor("output.weight", array)
            continue
        if not name.startswith("layers."):
            writer.add_tensor(f"{names[name]}.weight", array)
            continue
        _, layer, rest = name.split(".", 2)
        if rest == "mlp.experts.gate_up_proj":  # (E, 2I, H): gate rows, then up rows
            half = array.shape[1] // 2
            stacks = {"ffn_gate": array[:, :half], "ffn_up": array[:, half:]}
        elif rest == "mlp.experts.down_proj":
            stacks = {"ffn_down": array}
        else:
            if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if rest == "self_attn.q_proj" else cfg.num_key_value_heads
                array = llama_cpp_permute(array, heads)
            if rest == "mlp.shared_expert_gate":  # llama.cpp's {n_embd} shape
                array = array.reshape(-1)
            if attention_type is not None and rest.startswith("self_attn.") and rest.endswith("_proj") \
                    and kind == "weight":
                writer.add_tensor(f"blk.{layer}.{names[rest]}.weight", gguf.quants.quantize(array, attention_type),
                                  raw_dtype=attention_type)
                continue
            writer.add_tensor(f"blk.{layer}.{names[rest]}.{kind}", array)
            continue
        for base, stack in stacks.items():
            stack = np.ascontiguousarray(stack)
            if is_per_expert:
                for expert, weight in enumerate(stack):
                    writer.add_tensor(f"blk.{layer}.{base}.{expert}.weight", weight)
            elif expert_type is not None:
                writer.add_tensor(f"blk.{layer}.{base}_exps.weight", gguf.quants.quantize(stack, expert_type),
                                  raw_dtype=expert_type)
            else:
                writer.add_tensor(f"blk.{layer}.{base}_exps.weight", stack)
    finish_gguf(writer)
    return path


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, len(hf_tokenizer), (n,), generator=gen).tolist() for n in (9, 23, 40, 61)]


@torch.no_grad()
def assert_matches_hf(hf, llm: LLM, prompts: list[list[int]], where: str) -> None:
    """Prompt log-probabilities within 1e-4 of HF's; greedy tokens equal HF's full-forward greedy."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outputs = run_requests(llm.engine, {f"p{i}": (ids, params) for i, ids in enumerate(prompts)})
    for i, ids in enumerate(prompts):
        out = outputs[f"p{i}"]
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        want = expected.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        ours = torch.tensor([position[t].logprob for position, t in zip(out.prompt_logprobs[1:], ids[1:])])
        assert (ours - want).abs().max().item() <= 1e-4, f"{where} prompt {i}"
        prompt = torch.tensor([ids])
        greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, use_cache=False,
                             max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, pad_token_id=0)
        assert out.outputs[0].token_ids == greedy[0, len(ids):].tolist(), f"{where} prompt {i}"


@pytest.mark.parametrize("architecture, layout", [
    ("MixtralForCausalLM", "stacked"), ("MixtralForCausalLM", "per_expert"), ("Qwen3MoeForCausalLM", "stacked"),
    ("Qwen2MoeForCausalLM", "stacked")])
def test_a_gguf_with_experts_matches_hf(architecture, layout, hf_tokenizer, smollm_path, prompts, tmp_path):
    hf = build_hf(architecture, hf_tokenizer)
    path = write_moe_gguf(hf, architecture, tmp_path / "moe.gguf", smollm_path, is_per_expert=layout == "per_expert")
    cfg = read_gguf_config(path)
    num_experts = FAMILIES[architecture].get("num_local_experts") or FAMILIES[architecture]["num_experts"]
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_renormalize, cfg.moe_dense_layers) \
        == (architecture, num_experts, FAMILIES[architecture]["num_experts_per_tok"],
            FAMILIES[architecture].get("norm_topk_prob", True), ())
    assert cfg.moe_intermediate_size == FAMILIES[architecture].get("moe_intermediate_size", 48)
    assert cfg.shared_expert_intermediate_size == FAMILIES[architecture].get("shared_expert_intermediate_size", 0)
    llm = LLM(str(path), **SETTINGS)
    assert llm.engine.weight_bytes == weight_bytes(cfg, torch.float32)  # the planner's figure for the file
    assert_matches_hf(hf, llm, prompts, f"{architecture} {layout}")


@torch.no_grad()
def test_q8_0_experts_match_hf_on_the_dequantized_weights(hf_tokenizer, smollm_path, prompts, tmp_path):
    import gguf

    q8_0 = gguf.GGMLQuantizationType.Q8_0
    hf = build_hf("Qwen3MoeForCausalLM", hf_tokenizer)
    path = write_moe_gguf(hf, "Qwen3MoeForCausalLM", tmp_path / "q8.gguf", smollm_path, expert_type=q8_0)
    for name, param in hf.named_parameters():  # HF runs what the file holds
        if ".experts." in name:
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), q8_0), q8_0)))
    assert_matches_hf(hf, LLM(str(path), **SETTINGS), prompts, "Qwen3-MoE Q8_0 experts")


@torch.no_grad()
def test_quantization_gguf_keeps_a_mixtrals_q8_0_attention_blocks_and_dequantizes_its_experts(
        hf_tokenizer, smollm_path, prompts, tmp_path):
    """quantization gguf on a Mixtral whose attention and experts are Q8_0: q/k/v/o stay int8 blocks (q/k rows
    back in HF's order), the experts and the router are dequantized; HF holding the dequantized values is
    the reference."""
    import gguf

    from batchgen.engine.quant.int_linear import IntLinear

    q8_0 = gguf.GGMLQuantizationType.Q8_0
    hf = build_hf("MixtralForCausalLM", hf_tokenizer, intermediate_size=64)
    path = write_moe_gguf(hf, "MixtralForCausalLM", tmp_path / "q8.gguf", smollm_path, expert_type=q8_0,
                          attention_type=q8_0)
    for name, param in hf.named_parameters():  # HF runs what the file holds
        if ".experts." in name or (".self_attn." in name and name.endswith("_proj.weight")):
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), q8_0), q8_0)))
    llm = LLM(str(path), quantization="gguf", **SETTINGS)
    attention = llm.engine.runner.model.layers[1].self_attn
    assert isinstance(attention.qkv_proj, IntLinear) and isinstance(attention.o_proj, IntLinear)
    assert_matches_hf(hf, llm, prompts, "Mixtral Q8_0 attention kept")


@pytest.mark.subprocess
@torch.no_grad()
def test_tp2_on_a_gguf_with_experts_equals_one_process(hf_tokenizer, smollm_path, prompts, tmp_path):
    hf = build_hf("Qwen3MoeForCausalLM", hf_tokenizer)
    path = write_moe_gguf(hf, "Qwen3MoeForCausalLM", tmp_path / "moe.gguf", smollm_path)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = run_requests(LLM(str(path), **SETTINGS).engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    threads = torch.get_num_threads()
    tp = LLM(str(path), tensor_parallel_size=2, **SETTINGS)
    try:
        got = run_requests(tp.engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    finally:
        tp.engine.shutdown()
        torch.set_num_threads(threads)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in expected.items()}

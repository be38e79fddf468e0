"""gpt-oss (GptOssForCausalLM) against transformers' own class on a tiny random model.

Built by transformers (seeded, float32, eager attention, every weight random: sinks, biases, norm gains),
saved with save_pretrained beside the bundled tokenizer: attention sinks on every layer, layers
alternating a 20-token sliding window and full attention (transformers' default layer_types), YaRN
rotary (the published rope_parameters), a router with a bias (top k, then softmax), experts with biases,
interleaved gate/up and the clamped SwiGLU (weights scaled so that both clamps bind; asserted), and
every expert routed to (asserted through hooks on HF's routers).

Shown, on every attention path the CPU runs (the C kernels, SDPA; Triton under the interpreter for the
log-probabilities): prompt log-probabilities within 1e-4 of HF's float32 log-softmax on prompts longer
than the window; greedy 32-token outputs equal to HF `generate` on 8 prompts, alone and batched with
chunked prefill and prefix caching. A twin published as OpenAI publishes gpt-oss (MXFP4 experts: `*_blocks`
and `*_scales`, quantization_config mxfp4) generates the same greedy tokens as HF on the weights
transformers' own MXFP4 dequantizer gives. Its chat template (Harmony) renders through the engine's
sandboxed template rendering.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.models.config import ModelConfig
from tests.engine.helpers import (
    check_greedy_alone_and_batched,
    check_prompt_logprobs,
    run_requests,
    shared_prefix_prompts,
)
from tests.engine.models.test_registry import randomize_weights

NUM_TOKENS = 32
WINDOW = 20
CONFIG = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
SETTINGS = dict(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="64MiB")


def _tiny_gpt_oss(vocab_size: int):
    import transformers

    config = transformers.GptOssConfig(vocab_size=vocab_size, **CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomize_weights(transformers.GptOssForCausalLM(config).float().eval())
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # some sinks above the scores, some far below
            layer.mlp.experts.gate_up_proj.mul_(4.0)  # gate/up past the clamps on some rows
    return model


@pytest.fixture(scope="module")
def gpt_oss(hf_tokenizer, tmp_path_factory):
    """(HF model, its folder)."""
    model = _tiny_gpt_oss(len(hf_tokenizer))
    folder = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    """8 prompts of 6 to 70 tokens (most longer than the window); the first two share 40 tokens (two blocks)."""
    return shared_prefix_prompts(len(hf_tokenizer))


@torch.no_grad()
def hf_generate(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_TOKENS,
                      min_new_tokens=NUM_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(gpt_oss, prompts) -> list[list[int]]:
    """HF generate's greedy tokens for every prompt."""
    hf, _ = gpt_oss
    return [hf_generate(hf, ids) for ids in prompts]


def test_the_config_reads_sinks_windows_yarn_and_the_experts(gpt_oss):
    _, folder = gpt_oss
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    assert (cfg.architecture, cfg.attention_sinks, cfg.sliding_window, cfg.layer_types) == (
        "GptOssForCausalLM", True, WINDOW, ("sliding_attention", "full_attention", "sliding_attention"))
    assert [cfg.layer_sliding_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_router, cfg.moe_router_bias, cfg.moe_expert_bias,
            cfg.moe_swiglu_limit, cfg.moe_swiglu_alpha, cfg.attention_bias, cfg.o_proj_bias) == (
        8, 2, "topk_softmax", True, True, 7.0, 1.702, True, True)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 32.0


@pytest.mark.parametrize("backend", ["cpu", "sdpa", pytest.param("triton", marks=pytest.mark.triton)])
@torch.no_grad()
def test_prompt_logprobs_equal_hfs_log_softmax_with_every_expert_routed_and_both_clamps_binding(
        gpt_oss, prompts, backend):
    hf, folder = gpt_oss
    seen: dict[str, set[int]] = {}
    clamped = {"gate": False, "up": False}
    hooks = []
    for name, module in hf.named_modules():
        if name.endswith("mlp.router"):
            def on_route(_module, _inputs, output, name=name):
                seen.setdefault(name, set()).update(output[2].flatten().tolist())  # (logits, scores, indices)
            hooks.append(module.register_forward_hook(on_route))
        if name.endswith("mlp.experts"):
            def on_experts(module, inputs, _output):
                gate_up = inputs[0] @ module.gate_up_proj + module.gate_up_proj_bias[:, None]  # every expert
                clamped["gate"] |= bool((gate_up[..., 0::2] > module.limit).any())
                clamped["up"] |= bool((gate_up[..., 1::2].abs() > module.limit).any())
            hooks.append(module.register_forward_hook(on_experts))
    chosen = prompts if backend == "cpu" else [prompts[5], prompts[3]]  # the interpreter is slow: two prompts
    expected = [torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1) for ids in chosen]
    for hook in hooks:
        hook.remove()
    if backend == "cpu":
        assert len(seen) == 3 and all(s == set(range(8)) for s in seen.values()), seen
        assert clamped == {"gate": True, "up": True}

    llm = LLM(str(folder), max_num_batched_tokens=32, attention_backend=backend, **SETTINGS)  # 33+ tokens: chunks
    assert llm.engine.model_cfg.architecture == "GptOssForCausalLM"
    check_prompt_logprobs(llm.engine, chosen, expected, backend)


@torch.no_grad()
def test_greedy_tokens_equal_hf_generate_alone_and_batched_with_chunked_prefill(gpt_oss, prompts, reference):
    _, folder = gpt_oss
    check_greedy_alone_and_batched(folder, prompts, reference, NUM_TOKENS, SETTINGS, "gpt-oss")


def _as_published_mxfp4(hf, folder, tmp_path):
    """A copy of `folder` with its experts as OpenAI publishes them: random MXFP4 `*_blocks` / `*_scales`
    (rows (E, out, in / 32, 16), gate_up rows interleaved gate, up, ...), biases as they are,
    quantization_config mxfp4; and the same weights dequantized by transformers' own converter
    copied into `hf`'s experts (the twin)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    gen = torch.Generator().manual_seed(7)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()
                   if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    num, hidden, inter = 8, CONFIG["hidden_size"], CONFIG["intermediate_size"]
    for i, layer in enumerate(hf.model.layers):
        for projection, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            blocks = torch.randint(0, 256, (num, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(124, 128, (num, rows, cols // 32), generator=gen, dtype=torch.uint8)
            tensors[f"model.layers.{i}.mlp.experts.{projection}_blocks"] = blocks
            tensors[f"model.layers.{i}.mlp.experts.{projection}_scales"] = scales
            getattr(layer.mlp.experts, projection).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))


@torch.no_grad()
def test_mxfp4_experts_as_published_generate_the_tokens_of_their_dequantized_twin(hf_tokenizer, gpt_oss, prompts,
                                                                               tmp_path):
    _, folder = gpt_oss
    twin = _tiny_gpt_oss(len(hf_tokenizer))  # the same weights as `folder`, its experts then replaced
    _as_published_mxfp4(twin, folder, tmp_path)
    llm = LLM(str(tmp_path), **SETTINGS)
    assert llm.engine.model_cfg.moe_expert_format == "mxfp4"
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    chosen = {f"p{i}": prompts[i] for i in (0, 3, 5)}
    outputs = run_requests(llm.engine, {name: (ids, params) for name, ids in chosen.items()})
    for name, ids in chosen.items():
        assert outputs[name].outputs[0].token_ids == hf_generate(twin, ids), name


@pytest.mark.subprocess  # the second rank's process starts before the model refuses
def test_tensor_parallelism_is_refused_by_name(gpt_oss):
    _, folder = gpt_oss
    with pytest.raises(ValueError, match="GptOssForCausalLM: tensor_parallel_size > 1 is not supported"):
        LLM(str(folder), tensor_parallel_size=2, **SETTINGS)


# Harmony, as OpenAI's published chat template renders a conversation with a developer message and
# reasoning_effort "high" (the Harmony format's own example shape), ending with the assistant's turn header.
HARMONY_PROMPT = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                  "Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: high\n\n"
                  "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
                  "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n<|end|>"
                  "<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>assistant")


def test_the_harmony_chat_template_renders_through_the_sandboxed_tokenizer(gpt_oss):
    """gpt-oss's chat template (the copy TRL ships of OpenAI's, as a string: no download) through the
    engine's template rendering: the Harmony turns, reasoning_effort read, a tool call on the commentary
    channel with its analysis kept, the tool's result addressed back to the assistant."""
    import datetime

    from trl.chat_template_utils import gptoss_chat_template

    from batchgen.engine.text.chat_template import ChatTemplateOptions

    _, folder = gpt_oss
    tokenizer = LLM(str(folder), **SETTINGS).engine.tokenizer
    options = ChatTemplateOptions(chat_template=gptoss_chat_template, chat_template_kwargs={"reasoning_effort": "high"})
    messages = [{"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    date = datetime.date.today().strftime("%Y-%m-%d")
    assert tokenizer.render_chat(messages, options) == HARMONY_PROMPT.format(date=date)

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    turns = messages + [
        {"role": "assistant", "thinking": "Look it up.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}]
    with_tools = ChatTemplateOptions(chat_template=gptoss_chat_template, tools=tools)
    rendered = tokenizer.render_chat(turns, with_tools)
    assert "Calls to these tools must go to the commentary channel: 'functions'." in rendered
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in rendered
    assert rendered.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant')

"""Quantization quality benchmark: how far FP8 / int8 / int4 next-token distributions drift from the unquantized
model's; and how far bfloat16 (as the engine runs it on this CPU) drifts from float32 (run_dtype_quality_bench).

On the committed chat prompts, the unquantized model writes greedy reference completions. Both models
then read prompt + reference (teacher forcing), and over the completion positions only we report:
- top1_agreement: share of positions where both models' most likely next token is the same;
- mean_kl: mean KL(P_ref || P_fp8) per position, in nats;
- greedy_exact_match / greedy_token_agreement: the FP8 model's own greedy completion equals the
  reference / share of reference tokens reproduced before the first divergence.

Both models are the modules the engine runs: the quantized ones are the loaded float model quantized
by quantize_model_fp8 / quantize_model_int exactly as at load, so one checkpoint read serves every mode.
A GPTQ / AWQ / compressed-tensors folder is measured as the engine loads it (its own entry first)
against the same architecture in float32 holding the folder's dequantized weights
(dequantized_float_model), which is then also the float model the other modes start from.

CLI: python -m batchgen.bench.quality [--model M] [--num-prompts N] [--max-tokens T] [--fp8-mode w8a16 ...]
     [--quantization int8 --quantization int4]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging

import torch
from torch import nn

from batchgen.bench.quality_prompts import QUALITY_PROMPTS
from batchgen.engine.config import INT_CALIBRATIONS, EngineConfig
from batchgen.engine.loader.model_loader import model_weight_bytes
from batchgen.engine.quant.calibrate.activation_aware import calibration_windows
from batchgen.engine.quant.calibrate.sequence_runner import greedy_generate, teacher_forced_logits
from batchgen.engine.quant.fp8 import quantize_model_fp8
from batchgen.engine.quant.fp8_linear import Fp8Linear
from batchgen.engine.quant.int_checkpoint import IntLinearParts
from batchgen.engine.quant.int_linear import IntLinear
from batchgen.engine.quant.int_model import calibration_statistics, quantize_model_int
from batchgen.engine.quant.weight_report import unique_storage_bytes, weight_report
from batchgen.engine.text.token_prefix import num_shared_prefix

log = logging.getLogger("batchgen.bench")


def compare_logits(ref: list[torch.Tensor], test: list[torch.Tensor]) -> dict:
    """Top-1 agreement and mean KL(ref || test) over all rows of per-prompt (C, V) logits."""
    ref_all, test_all = torch.cat(ref).double(), torch.cat(test).double()  # (P, V)
    ref_logp, test_logp = ref_all.log_softmax(-1), test_all.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - test_logp)).sum(-1)  # (P,)
    agree = ref_all.argmax(-1) == test_all.argmax(-1)
    return {"num_positions": int(agree.numel()), "top1_agreement": agree.double().mean().item(),
            "mean_kl": kl.mean().item(), "max_kl": kl.max().item()}


def compare_greedy(ref: list[list[int]], test: list[list[int]]) -> dict:
    """Share of completions identical to the reference, and of reference tokens reproduced before
    each completion's first difference."""
    return {"greedy_exact_match": sum(a == b for a, b in zip(ref, test)) / len(ref),
            "greedy_token_agreement": sum(num_shared_prefix(a, b) for a, b in zip(ref, test)) / sum(map(len, ref))}


QUANTIZED_LAYERS = (Fp8Linear, IntLinear, IntLinearParts)
INT_LAYERS = (IntLinear, IntLinearParts)
INT_METHODS = ("int8", "int4")


def dequantized_float_model(model: nn.Module) -> nn.Module:
    """A copy of `model` whose integer layers are float32 nn.Linear holding exactly the weights those
    layers multiply by (IntLinear.dequantized_weight) and their biases; everything else is copied."""
    if any(isinstance(m, Fp8Linear) for m in model.modules()):
        raise ValueError("the quality bench compares integer checkpoints with their dequantized weights; "
                         "this model holds FP8 layers")
    memo: dict[int, nn.Module] = {}  # deepcopy takes these as the layers' copies: no integer buffers copied
    for module in model.modules():
        if isinstance(module, INT_LAYERS):
            weight = module.dequantized_weight()  # (N, K) float32
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device=weight.device)
            linear.weight = nn.Parameter(weight, requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.detach().float().clone(), requires_grad=False)
            memo[id(module)] = linear
    return copy.deepcopy(model, memo)


def encode_prompts(tokenizer, prompts: list) -> list[list[int]]:
    """Token ids of raw strings or chat message lists; a tokenizer without a chat template reads the
    messages' text as one raw prompt (small test checkpoints have none)."""
    def encode(p):
        if isinstance(p, str):
            return tokenizer.encode(p)
        if tokenizer.has_chat_template:
            return tokenizer.encode_messages(p)
        return tokenizer.encode(" ".join(m["content"] for m in p))
    return [encode(p) for p in prompts]


def linear_bytes_ratio(float_model: torch.nn.Module, fp8_model: torch.nn.Module) -> dict:
    """Storage bytes of the quantized layers (weights + scales) over those of the same layers in the float model
    (the keys keep their FP8 names: num_fp8_layers, linear_fp8_bytes)."""
    fp8_layers = {n: m for n, m in fp8_model.named_modules() if isinstance(m, QUANTIZED_LAYERS)
                  and ".parts." not in n}
    float_bytes = sum(unique_storage_bytes(float_model.get_submodule(n)) for n in fp8_layers)
    fp8_bytes = sum(unique_storage_bytes(m) for m in fp8_layers.values())
    return {"num_fp8_layers": len(fp8_layers), "linear_float_bytes": float_bytes, "linear_fp8_bytes": fp8_bytes,
            "linear_bytes_ratio": fp8_bytes / float_bytes}


def run_quality_bench(model: str = "smollm2-135m-instruct", prompts: list | None = None, max_tokens: int = 32,
                      fp8_mode: str | list[str] = ("w8a16", "w8a8"), num_prompts: int | None = None,
                      dtype: str = "float32", device: str = "cpu", quantize_lm_head: bool = False,
                      engine=None, int_methods: list[str] | tuple = (), greedy: bool = True,
                      reference: nn.Module | None = None,
                      int_calibrations: list[str] | tuple = (EngineConfig.int_calibration,)) -> dict:
    """Compare the FP8 model (one entry per fp8_mode) and the int8 / int4 models (one per int_methods entry)
    with the unquantized one; returns a JSON-able dict.

    prompts: chat message lists or raw strings (default: the committed QUALITY_PROMPTS, first num_prompts).
    engine: an unquantized LLMEngine whose loaded weights and tokenizer to reuse (then model, dtype and
    device are its own); None loads `model` once. greedy=False skips the int8 / int4 models' own greedy
    runs (their greedy_* keys are then absent; FP8 entries always have them).
    model a GPTQ / AWQ / compressed-tensors folder: the first entry is that folder's engine (quantization
    gptq / awq / compressed-tensors) against its dequantized float32 copy, or against `reference`, a
    float model of the same architecture given instead (tests: a perturbed copy).
    int_calibrations: each int method runs once per value (activation_aware calibrates on the bundled
    text through the reference model, as the loader does).
    """
    modes = [fp8_mode] if isinstance(fp8_mode, str) else list(fp8_mode)
    prompts = list(prompts if prompts is not None else QUALITY_PROMPTS)[:num_prompts]
    if engine is None:
        from batchgen.engine.loader.model_loader import load_model
        from batchgen.engine.text.tokenizer import Tokenizer

        config = EngineConfig(model=model, dtype=dtype, device=device, max_model_len=2048)
        loaded = load_model(config)
        ref_model, tokenizer = loaded.model, Tokenizer(loaded.source)
        eos = tuple(sorted(set(loaded.model_cfg.eos_token_ids) | {tokenizer.eos_token_id} - {None}))
        loaded_weights = loaded.weights
    else:
        config, ref_model, tokenizer, eos = engine.config, engine.runner.model, engine.tokenizer, engine.eos_token_ids
        model, device = config.model, str(config.torch_device)
        loaded_weights = engine.stats["weights"]
        if any(isinstance(m, QUANTIZED_LAYERS) for m in ref_model.modules()):
            raise ValueError("the reference engine must run the unquantized model")
    checkpoint_model = None  # the integer checkpoint's own model, as the engine loaded it
    if loaded_weights.get("origin") == "checkpoint" and any(isinstance(m, INT_LAYERS) for m in ref_model.modules()):
        checkpoint_model = ref_model
        ref_model = reference if reference is not None else dequantized_float_model(checkpoint_model)
    elif reference is not None:
        raise ValueError(f"reference replaces an integer checkpoint's dequantized copy; {model} is not one")
    prompt_ids = encode_prompts(tokenizer, prompts)
    references = greedy_generate(ref_model, prompt_ids, max_tokens, eos)
    ref_logits = teacher_forced_logits(ref_model, prompt_ids, references)
    # Sanity check of the harness: the reference's own argmax reproduces its greedy tokens.
    ref_self = sum((lg.argmax(-1).tolist() == r) for lg, r in zip(ref_logits, references)) / len(references)
    result = {"model": model, "dtype": str(config.torch_dtype).removeprefix("torch."), "device": device,
              "num_prompts": len(prompts), "max_tokens": max_tokens,
              "num_completion_tokens": sum(map(len, references)), "reference_self_consistency": ref_self,
              "float_weight_bytes": model_weight_bytes(ref_model), "results": []}
    if checkpoint_model is not None:
        method = loaded_weights["format"]
        entry = {"quantization": method, "fp8_mode": None, "fp8_weight_bytes": model_weight_bytes(checkpoint_model),
                 "weights": loaded_weights, **linear_bytes_ratio(ref_model, checkpoint_model),
                 **compare_logits(ref_logits, teacher_forced_logits(checkpoint_model, prompt_ids, references)),
                 **compare_greedy(references, greedy_generate(checkpoint_model, prompt_ids, max_tokens, eos))}
        log.info("%s checkpoint quality: top-1 agreement %.2f%%, mean KL %.4f", method,
                 100 * entry["top1_agreement"], entry["mean_kl"])
        result["results"].append(entry)
    variants = [("fp8", mode, None) for mode in modes]
    variants += [(method, None, calibration) for method in int_methods for calibration in int_calibrations]
    statistics = None  # one calibration pass of the float model serves every activation-aware variant
    if any(c == "activation_aware" for _, _, c in variants):
        windows = calibration_windows(tokenizer, config.max_model_len or 2048, ref_model.cfg.vocab_size)
        statistics = calibration_statistics(ref_model, config.replace(quantize_lm_head=quantize_lm_head), windows)
    for method, mode, calibration in variants:
        quantized = copy.deepcopy(ref_model)
        if method == "fp8":
            quantize_model_fp8(quantized, config.replace(quantization="fp8", fp8_mode=mode,
                                                          quantize_lm_head=quantize_lm_head))
        else:
            quantize_model_int(quantized, config.replace(quantization=method, quantize_lm_head=quantize_lm_head,
                                                         int_calibration=calibration), method,
                               statistics=statistics)
        entry = {"quantization": method, "fp8_mode": mode, "int_calibration": calibration,
                 "fp8_weight_bytes": model_weight_bytes(quantized),
                 "weights": weight_report(quantized, method, "at load"),
                 **linear_bytes_ratio(ref_model, quantized),
                 **compare_logits(ref_logits, teacher_forced_logits(quantized, prompt_ids, references))}
        if greedy or method == "fp8":
            entry.update(compare_greedy(references, greedy_generate(quantized, prompt_ids, max_tokens, eos)))
        log.info("%s quality%s: top-1 agreement %.2f%%, mean KL %.4f", method, f" {mode or calibration}",
                 100 * entry["top1_agreement"], entry["mean_kl"])
        result["results"].append(entry)
        del quantized
    return result


def run_kv_cache_quality_bench(model: str = "smollm2-135m-instruct", kv_cache_dtype: str = "fp8",
                               prompts: list | None = None, max_tokens: int = 32, num_prompts: int | None = None,
                               calculate_kv_scales: bool = False, engine=None) -> dict:
    """An FP8 KV cache against the float32 cache on the same float32 model: teacher-forced top-1
    agreement and mean KL, greedy agreement, and what the engine reports for each cache (dtype,
    bytes per token). Both read every key from the cache, as the engine does, prefix and new tokens
    alike. engine: a float32 CPU LLMEngine to reuse (None loads `model`)."""
    from batchgen.engine.core.llm_engine import LLMEngine

    if engine is None:
        engine = LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", max_model_len=2048,
                                        kv_cache_memory="256MiB"))
    fp8_engine = LLMEngine(engine.config.replace(kv_cache_dtype=kv_cache_dtype,
                                                 calculate_kv_scales=calculate_kv_scales), weights_from=engine)
    ref_model, tokenizer, eos = engine.runner.model, engine.tokenizer, engine.eos_token_ids
    kv_options = dict(kv_cache_dtype=fp8_engine.config.kv_torch_dtype, calculate_kv_scales=calculate_kv_scales)
    prompts = list(prompts if prompts is not None else QUALITY_PROMPTS)[:num_prompts]
    prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else tokenizer.encode_messages(p) for p in prompts]
    references = greedy_generate(ref_model, prompt_ids, max_tokens, eos)
    ref_logits = teacher_forced_logits(ref_model, prompt_ids, references)
    float_kv, fp8_kv = engine.stats["kv_cache"], fp8_engine.stats["kv_cache"]
    entry = {"kv_cache_dtype": kv_cache_dtype, "calculate_kv_scales": calculate_kv_scales,
             "engine_kv_cache": fp8_kv, "kv_bytes_ratio": fp8_kv["bytes_per_token"] / float_kv["bytes_per_token"],
             **compare_logits(ref_logits, teacher_forced_logits(ref_model, prompt_ids, references, **kv_options)),
             **compare_greedy(references, greedy_generate(ref_model, prompt_ids, max_tokens, eos, **kv_options))}
    log.info("fp8 KV quality %s: top-1 agreement %.2f%%, mean KL %.4f, %d vs %d bytes/token", kv_cache_dtype,
             100 * entry["top1_agreement"], entry["mean_kl"], fp8_kv["bytes_per_token"], float_kv["bytes_per_token"])
    return {"model": engine.config.model, "dtype": "float32", "device": "cpu", "num_prompts": len(prompts),
            "max_tokens": max_tokens, "num_completion_tokens": sum(map(len, references)),
            "reference_kv_cache": float_kv, "kv_results": [entry]}


def hf_greedy(model: str, prompt_ids: list[list[int]], max_tokens: int, dtype: torch.dtype,
              eos_token_ids: tuple[int, ...]) -> list[list[int]]:
    """HF transformers' own model in `dtype`, greedy, one prompt at a time (no padding), cut after EOS."""
    from batchgen.bench.peer import load_peer_model

    hf_model = load_peer_model(model, dtype)
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf_model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_tokens, do_sample=False, num_beams=1,
                                    eos_token_id=list(eos_token_ids), pad_token_id=eos_token_ids[0])
            outputs.append(out[0, len(ids):].tolist())
    eos = set(eos_token_ids)
    return [o[:next((i + 1 for i, t in enumerate(o) if t in eos), len(o))] for o in outputs]


def run_dtype_quality_bench(model: str = "smollm2-135m-instruct", dtype: str = "bfloat16",
                            prompts: list | None = None, max_tokens: int = 32, num_prompts: int | None = None,
                            engine=None, compare_hf: bool = True) -> dict:
    """The model in `dtype` as the engine runs it on this CPU (bfloat16: on BF16 units or widened,
    engine/capabilities.py) against float32: teacher-forced top-1 agreement and mean KL over the float32
    model's greedy completions, and greedy agreement; with compare_hf, also greedy agreement with HF
    transformers' own model in the same dtype (a reference, not the truth: its bf16 rounds elsewhere).
    engine: a float32 CPU LLMEngine to reuse as the reference (None loads `model`)."""
    from batchgen.engine.loader.model_loader import load_model
    from batchgen.engine.text.tokenizer import Tokenizer

    if engine is None:
        reference = load_model(EngineConfig(model=model, dtype="float32", device="cpu", max_model_len=2048))
        ref_model, tokenizer = reference.model, Tokenizer(reference.source)
        eos = tuple(sorted(set(reference.model_cfg.eos_token_ids) | {tokenizer.eos_token_id} - {None}))
        config = EngineConfig(model=model, dtype="float32", device="cpu", max_model_len=2048)
    else:
        config, ref_model, tokenizer, eos = engine.config, engine.runner.model, engine.tokenizer, engine.eos_token_ids
        if config.torch_dtype != torch.float32 or config.torch_device.type != "cpu":
            raise ValueError("the dtype quality bench compares against a float32 CPU engine")
        model = config.model
    loaded = load_model(config.replace(dtype=dtype))
    prompts = list(prompts if prompts is not None else QUALITY_PROMPTS)[:num_prompts]
    prompt_ids = encode_prompts(tokenizer, prompts)
    references = greedy_generate(ref_model, prompt_ids, max_tokens, eos)
    ref_logits = teacher_forced_logits(ref_model, prompt_ids, references)
    ours = greedy_generate(loaded.model, prompt_ids, max_tokens, eos)
    entry = {"dtype": dtype, "kernels": loaded.capabilities.as_dict(),
             "weight_bytes": loaded.weight_bytes, "float32_weight_bytes": model_weight_bytes(ref_model),
             **compare_logits(ref_logits, teacher_forced_logits(loaded.model, prompt_ids, references)),
             **compare_greedy(references, ours)}
    if compare_hf:
        theirs = hf_greedy(model, prompt_ids, max_tokens, loaded.model.embed_tokens.weight.dtype, eos)
        entry["vs_hf_same_dtype"] = compare_greedy(theirs, ours)
    log.info("%s quality: top-1 agreement %.2f%%, mean KL %.4f (%s)", dtype, 100 * entry["top1_agreement"],
             entry["mean_kl"], loaded.capabilities.bf16_path)
    return {"model": model, "dtype": "float32", "device": "cpu", "num_prompts": len(prompts), "max_tokens": max_tokens,
            "num_completion_tokens": sum(map(len, references)), "dtype_results": [entry]}


def format_dtype_quality_table(result: dict) -> str:
    lines = [(f"{result['model']} (reference float32, {result['device']}): {result['num_prompts']} prompts, "
              f"{result['num_completion_tokens']} reference tokens"),
             "dtype      path        weight bytes  top-1 agree  mean KL   greedy exact  greedy tokens  vs HF same dtype"]
    for r in result["dtype_results"]:
        hf = r.get("vs_hf_same_dtype")
        hf_text = f"{hf['greedy_exact_match']:.1%} exact, {hf['greedy_token_agreement']:.1%} tokens" if hf else "-"
        lines.append(f"{r['dtype']:<10} {r['kernels'].get('bf16_path') or '-':<11} "
                     f"{r['weight_bytes'] / r['float32_weight_bytes']:>11.1%}  {r['top1_agreement']:>10.2%}  "
                     f"{r['mean_kl']:>7.4f}  {r['greedy_exact_match']:>12.1%}  {r['greedy_token_agreement']:>12.1%}  "
                     f"{hf_text}")
    return "\n".join(lines)


def format_kv_quality_table(result: dict) -> str:
    ref = result["reference_kv_cache"]
    lines = [f"{result['model']} (float32 weights, {result['device']}): {result['num_prompts']} prompts, "
             f"{result['num_completion_tokens']} reference tokens; reference KV cache {ref['dtype']} "
             f"({ref['bytes_per_token']:,} B/token)",
             "KV cache        bytes/token  ratio  top-1 agree  mean KL   greedy exact  greedy tokens"]
    for r in result["kv_results"]:
        kv = r["engine_kv_cache"]
        lines.append(f"{kv['dtype']:<15} {kv['bytes_per_token']:>11,}  {r['kv_bytes_ratio']:>5.2f}  "
                     f"{r['top1_agreement']:>10.2%}  {r['mean_kl']:>7.4f}  {r['greedy_exact_match']:>12.1%}  "
                     f"{r['greedy_token_agreement']:>12.1%}")
    return "\n".join(lines)


def format_quality_table(result: dict) -> str:
    if "kv_results" in result:
        return format_kv_quality_table(result)
    if "dtype_results" in result:
        return format_dtype_quality_table(result)
    lines = [f"{result['model']} ({result['dtype']}, {result['device']}): {result['num_prompts']} prompts, "
             f"{result['num_completion_tokens']} reference tokens",
             "mode        linear bytes  top-1 agree  mean KL   greedy exact  greedy tokens"]
    for r in result["results"]:
        label = f"fp8 {r['fp8_mode']}" if r.get("fp8_mode") else r["quantization"]
        if r.get("int_calibration") == "none":
            label += " rtn"
        greedy = (f"  {r['greedy_exact_match']:>12.1%}  {r['greedy_token_agreement']:>12.1%}"
                  if "greedy_exact_match" in r else "")
        lines.append(f"{label:<11} {r['linear_bytes_ratio']:>11.1%}  {r['top1_agreement']:>10.2%}  "
                     f"{r['mean_kl']:>7.4f}{greedy}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="FP8 vs unquantized: teacher-forced top-1 agreement and KL")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--fp8-mode", action="append", choices=["w8a16", "w8a8"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantization", action="append", choices=list(INT_METHODS),
                        help="also compare int8 / int4 weights quantized at load (repeatable)")
    parser.add_argument("--int-calibration", action="append", choices=list(INT_CALIBRATIONS),
                        help="int8 / int4: activation_aware (default) and/or none (round to nearest; repeatable)")
    parser.add_argument("--quantize-lm-head", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = run_quality_bench(args.model, max_tokens=args.max_tokens, fp8_mode=args.fp8_mode or ["w8a16", "w8a8"],
                               num_prompts=args.num_prompts, dtype=args.dtype, device=args.device,
                               quantize_lm_head=args.quantize_lm_head, int_methods=args.quantization or (),
                               int_calibrations=args.int_calibration or (EngineConfig.int_calibration,))
    print(json.dumps(result, indent=2) if args.json else format_quality_table(result))


if __name__ == "__main__":
    main()

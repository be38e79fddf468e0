"""Where int4 round-to-nearest loses quality: the weight error per layer, and whether the kernels add any.

1. For every decoder linear layer, the relative error ||W - deq(q(W))|| / ||W|| of the engine's int4
   quantizer (quantize_int4_groups, what `quantization: int4` runs at load with `int_calibration: none`)
   at several group sizes,
   beside two quantizers written here from their definitions, independently of the engine's:
   - rtn: asymmetric, per group s = (max - min) / 15, z = round(-min / s) clamped to 0..15,
     q = clamp(round(w / s) + z, 0, 15), w' = (q - z) s (integer zero points: the `int4` method);
   - float minimum: q = round((w - min) / s), w' = q s + min (GGUF Q4_1's form; a float offset).
   On a GGUF Q4_1 model the float-minimum variant at group 32 gives back the weights exactly (they
   are Q4_1 blocks): the reference is already 4-bit, and `int4` re-quantizes it on another grid.
2. Teacher-forced top-1 / KL against the float model (the quality bench's harness) of the engine's
   int4 model (IntLinear kernels) and of the same weights dequantized into plain nn.Linear (fake
   quantization), and their agreement with each other: equal figures mean the kernels add no error.

CLI: python -m batchgen.bench.int_rtn_error [--model M] [--num-prompts 16] [--max-tokens 32] [--no-logits]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from torch import nn

from batchgen.engine.quant.int_formats.rtn import quantize_int4_groups
from batchgen.engine.quant.weight_report import linear_layers

GROUP_SIZES = (128, 64, 32)


def rtn_reference(weight: torch.Tensor, group_size: int, float_minimum: bool = False) -> torch.Tensor:
    """(N, K) float32 -> the (N, K) float32 weight after asymmetric 4-bit round to nearest per group
    of `group_size` columns (the last group shorter), with integer zero points or a float minimum."""
    w = weight.detach().float()
    out = torch.empty_like(w)
    for lo in range(0, w.shape[1], group_size):
        block = w[:, lo:lo + group_size]  # (N, g)
        low, high = block.amin(dim=1, keepdim=True), block.amax(dim=1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)  # (N, 1)
        if float_minimum:
            out[:, lo:lo + group_size] = torch.round((block - low) / scale).clamp(0, 15) * scale + low
        else:
            zero = torch.round(-low / scale).clamp(0, 15)
            out[:, lo:lo + group_size] = ((torch.round(block / scale) + zero).clamp(0, 15) - zero) * scale
    return out


def relative_error(weight: torch.Tensor, approx: torch.Tensor) -> float:
    return ((weight - approx).norm() / weight.norm()).item()


def layer_errors(model: nn.Module, group_sizes: tuple[int, ...] = GROUP_SIZES) -> list[dict]:
    """One row per decoder linear layer: {name, shape, engine_g, rtn_g, float_min_g} relative errors."""
    rows = []
    for name, module in linear_layers(model).items():
        w = module.weight.detach().float()  # (N, K); oneDNN-packed layers unpack here
        row = {"name": name, "shape": list(w.shape)}
        for g in group_sizes:
            row[f"engine_g{g}"] = relative_error(w, quantize_int4_groups(w, g).dequantize())
            row[f"rtn_g{g}"] = relative_error(w, rtn_reference(w, g))
            row[f"float_min_g{g}"] = relative_error(w, rtn_reference(w, g, float_minimum=True))
        rows.append(row)
    return rows


def by_layer_type(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Mean of each error column per layer type (qkv_proj, o_proj, gate_up_proj, down_proj) and overall."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["name"].rsplit(".", 1)[-1], []).append(r)
    groups["all"] = rows
    columns = [k for k in rows[0] if k not in ("name", "shape")]
    return {kind: {c: sum(r[c] for r in rs) / len(rs) for c in columns} for kind, rs in groups.items()}


def fake_quantized(model: nn.Module) -> nn.Module:
    """A copy of `model` whose decoder linear layers are plain nn.Linear holding the int4 weights
    dequantized (the same codes `quantization: int4` makes), multiplied in float32 as any float layer."""
    replaced = copy.deepcopy(model)
    for name, module in linear_layers(replaced).items():
        w = module.weight.detach().float()
        linear = nn.Linear(w.shape[1], w.shape[0], bias=module.bias is not None)
        linear.weight = nn.Parameter(quantize_int4_groups(w).dequantize(), requires_grad=False)
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(replaced.get_submodule(parent), child, linear)
    return replaced


def kernel_against_fake_quantization(model: nn.Module, tokenizer, eos: tuple[int, ...], prompts: list,
                                     max_tokens: int) -> dict:
    """Teacher-forced figures against `model` (float) of its int4 model through the IntLinear kernels
    and through fake quantization, and of the kernels against fake quantization."""
    from batchgen.bench.quality import compare_logits, encode_prompts
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.quant.calibrate.sequence_runner import greedy_generate, teacher_forced_logits
    from batchgen.engine.quant.int_model import quantize_model_int

    prompt_ids = encode_prompts(tokenizer, prompts)
    references = greedy_generate(model, prompt_ids, max_tokens, eos)
    ref_logits = teacher_forced_logits(model, prompt_ids, references)
    kernels = copy.deepcopy(model)
    quantize_model_int(kernels, EngineConfig(model="unused", dtype="float32", device="cpu", int_calibration="none"),
                       "int4")
    kernel_logits = teacher_forced_logits(kernels, prompt_ids, references)
    del kernels
    fake_logits = teacher_forced_logits(fake_quantized(model), prompt_ids, references)
    return {"kernels_vs_float": compare_logits(ref_logits, kernel_logits),
            "fake_quantized_vs_float": compare_logits(ref_logits, fake_logits),
            "kernels_vs_fake_quantized": compare_logits(fake_logits, kernel_logits)}


def format_error_table(summary: dict[str, dict[str, float]]) -> str:
    columns = list(next(iter(summary.values())))
    lines = ["relative weight error ||W - deq(q(W))|| / ||W||, mean over layers",
             "layer          " + " ".join(f"{c:>14}" for c in columns)]
    for kind, values in summary.items():
        lines.append(f"{kind:<14} " + " ".join(f"{values[c]:>14.4f}" for c in columns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from batchgen.bench.quality_prompts import QUALITY_PROMPTS
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.loader.model_loader import load_model
    from batchgen.engine.text.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description="int4 round to nearest: weight error per layer, kernels vs "
                                                 "fake quantization")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-logits", action="store_true", help="only the weight errors")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    loaded = load_model(EngineConfig(model=args.model, dtype="float32", device="cpu", max_model_len=2048))
    rows = layer_errors(loaded.model)
    result = {"model": args.model, "by_layer_type": by_layer_type(rows), "layers": rows}
    if not args.no_logits:
        tokenizer = Tokenizer(loaded.source)
        eos = tuple(sorted(set(loaded.model_cfg.eos_token_ids) | {tokenizer.eos_token_id} - {None}))
        result["logits"] = kernel_against_fake_quantization(loaded.model, tokenizer, eos,
                                                            QUALITY_PROMPTS[:args.num_prompts], args.max_tokens)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(format_error_table(result["by_layer_type"]))
    for label, r in result.get("logits", {}).items():
        print(f"{label:<26} top-1 {r['top1_agreement']:.2%}  mean KL {r['mean_kl']:.3g}  "
              f"({r['num_positions']} positions)")


if __name__ == "__main__":
    main()

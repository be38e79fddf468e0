"""FP8 on a GPU, one command: python -m batchgen.bench.gpu_check [--layers 32] [--json-out FILE]

1. Matmul correctness at Llama-3-8B's layer shapes: bf16, FP8 w8a8 (torch._scaled_mm, per-token
   activation scales) and FP8 w8a16 against a float32 matmul of the same weights.
2. GEMM time per layer shape: bf16 torch.mm vs FP8 _scaled_mm (decode-sized and prefill-sized M).
3. Decode throughput of a random-weight model of Llama-3-8B shape (all 32 layers unless --layers):
   bf16, then the same weights quantized in place to FP8 (auto mode = w8a8 on >= 8.9; w8a16 with
   dequantize-then-matmul, and with the Triton kernel where its probe passes),
   through the engine's own model and torch attention (no CUDA graphs), side by side.

`--tiny` runs all of it at toy sizes on any device (the test suite runs it on the CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from batchgen.bench.direct_runner import DirectRunner
from batchgen.engine.attention import select_attention_backend
from batchgen.engine.config import EngineConfig
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.llama import LlamaForCausalLM
from batchgen.engine.quant.fp8 import can_use_triton_w8a16, quantize_model_fp8
from batchgen.engine.quant.fp8_linear import Fp8Linear

# Rounding to E4M3 moves a weight by <= 2**-4 of itself, RMS <= 2**-4/sqrt(3); activations too: x sqrt(2).
W8A16_REL_BOUND = 2.0**-4 / 3**0.5
W8A8_REL_BOUND = 2**0.5 * W8A16_REL_BOUND


def llama3_8b_config(num_layers: int = 32) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=num_layers, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)


def tiny_config() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=512, tie_word_embeddings=False)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@torch.inference_mode()
def check_matmuls(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, num_tokens: int = 64) -> list[dict]:
    """Relative error vs a float32 matmul for the model dtype, w8a8 and w8a16 at every layer shape."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in cfg.linear_shapes().items():
        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.float32)
        linear.weight.normal_(0, 0.02, generator=gen)
        x = torch.randn(num_tokens, k, device=device, generator=gen)
        ref = linear(x)  # float32
        linear = linear.to(dtype)
        row = {"layer": name, "shape": [num_tokens, k, n], "dtype": rel_error(linear(x.to(dtype)), ref)}
        fp8 = Fp8Linear.from_linear(linear)
        for mode in ("w8a8", "w8a16"):
            fp8.set_mode(mode)
            row[mode] = rel_error(fp8(x.to(dtype)), ref)
        row["ok"] = row["w8a8"] < W8A8_REL_BOUND and row["w8a16"] < W8A16_REL_BOUND * 1.1  # bf16 rounding on top
        rows.append(row)
    return rows


def _time(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call (after one warm-up call)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


@torch.inference_mode()
def time_gemms(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, token_counts: list[int],
               repeats: int) -> list[dict]:
    """Model-dtype mm vs FP8 w8a8 (activation quantization included) per layer shape and token count."""
    rows = []
    for name, (n, k) in cfg.linear_shapes().items():
        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        fp8 = Fp8Linear.from_linear(linear, mode="w8a8")
        for m in token_counts:
            x = torch.randn(m, k, device=device, dtype=dtype)
            t_dense = _time(lambda x=x: linear(x), device, repeats)
            t_fp8 = _time(lambda x=x: fp8(x), device, repeats)
            rows.append({"layer": name, "tokens": m, "dense_us": t_dense * 1e6, "fp8_us": t_fp8 * 1e6,
                         "speedup": t_dense / t_fp8})
    return rows


def build_random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_len: int) -> LlamaForCausalLM:
    backend = select_attention_backend("auto", device, dtype, cfg.head_dim)(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_len, backend)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    # Rotary tables are computed, not parameters: rebuild them on the device as the loader does.
    from batchgen.engine.models.rotary import RotaryEmbedding

    model.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model.eval()


@torch.inference_mode()
def decode_throughput(model: LlamaForCausalLM, batch: int, context: int, steps: int) -> float:
    """Decode tokens/s for `batch` sequences that each hold `context` prompt tokens (prefill untimed)."""
    cfg = model.cfg
    device = model.embed_tokens.weight.device
    runner = DirectRunner(model, batch, context + steps + 1)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (batch, context), generator=gen).tolist()
    tokens = runner.forward(prompts, [0] * batch).argmax(-1).tolist()
    lens = [context] * batch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        tokens = runner.forward([[t] for t in tokens], lens).argmax(-1).tolist()  # host sync, as the engine
        lens = [n + 1 for n in lens]
    return batch * steps / (time.perf_counter() - start)


@torch.inference_mode()
def logits_drift(model: LlamaForCausalLM, reference_logits: torch.Tensor, tokens: list[list[int]]) -> float:
    runner = DirectRunner(model, len(tokens), len(tokens[0]))
    return rel_error(runner.forward(tokens, [0] * len(tokens)), reference_logits)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    cfg = tiny_config() if args.tiny else llama3_8b_config(args.layers)
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "model": "tiny" if args.tiny else "llama-3-8b-shape",
            "num_layers": cfg.num_layers}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
    say = print if not args.quiet else (lambda *a, **k: None)
    say(json.dumps(info))

    matmuls = check_matmuls(cfg, device, dtype)
    say("\nmatmul relative error vs float32 (64 tokens):")
    for r in matmuls:
        say(f"  {r['layer']:<13} {str(r['shape']):<22} {info['dtype']} {r['dtype']:.4f}  w8a8 {r['w8a8']:.4f}  "
            f"w8a16 {r['w8a16']:.4f}  {'ok' if r['ok'] else 'TOO LARGE'}")

    gemms = time_gemms(cfg, device, dtype, args.gemm_tokens, args.repeats)
    say(f"\nGEMM time, {info['dtype']} vs FP8 w8a8 (incl. activation quantization):")
    for r in gemms:
        say(f"  {r['layer']:<13} M={r['tokens']:<5} {r['dense_us']:9.1f} us  {r['fp8_us']:9.1f} us  x{r['speedup']:.2f}")

    max_len = max(args.context + args.steps + 1, 16)  # 16: the logits-drift probe
    model = build_random_model(cfg, device, dtype, max_len)
    probe = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)).tolist()
    reference_logits = DirectRunner(model, 2, 16).forward(probe, [0, 0])
    decode = {info["dtype"]: {b: decode_throughput(model, b, args.context, args.steps) for b in args.batch_sizes}}
    summary = quantize_model_fp8(model, EngineConfig(model="random", device=str(device), quantization="fp8",
                                                     fp8_mode="auto"))
    # (mode, Triton kernel for w8a16): the auto choice first, then the other weight-only variants here.
    variants = [(summary["fp8_mode"], summary["uses_triton"])]
    variants += [v for v in (("w8a16", False), ("w8a16", can_use_triton_w8a16(device, dtype))) if v not in variants]
    drift = {}
    for mode, use_triton in variants:
        for m in model.modules():
            if isinstance(m, Fp8Linear):
                m.set_mode(mode)
                m.use_triton = use_triton
        name = f"{mode}{' triton' if use_triton else ''}"
        drift[name] = logits_drift(model, reference_logits, probe)
        decode[f"fp8 {name}"] = {b: decode_throughput(model, b, args.context, args.steps) for b in args.batch_sizes}
    say(f"\ndecode tokens/s, context {args.context}, {args.steps} steps; fp8 linear bytes "
        f"{summary['num_fp8_bytes'] / 1e9:.2f} GB ({summary['num_fp8_bytes'] / summary['num_float_bytes']:.1%} "
        f"of {info['dtype']}); auto mode: {summary['fp8_mode']} ({summary['reason']})")
    say("  batch  " + "  ".join(f"{name:>12}" for name in decode))
    for b in args.batch_sizes:
        say(f"  {b:<5}  " + "  ".join(f"{decode[name][b]:12.1f}" for name in decode))
    say("  logits drift vs " + info["dtype"] + ": " + ", ".join(f"{m} {d:.4f}" for m, d in drift.items()))
    result = {**info, "matmul_errors": matmuls, "gemm_times": gemms, "fp8_summary": summary,
              "decode_tokens_per_s": decode, "logits_rel_drift": drift,
              "all_matmuls_ok": all(r["ok"] for r in matmuls)}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes (runs anywhere, for the test suite)")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the Llama-3-8B-shape model")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--gemm-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch_sizes, args.context, args.steps = [b for b in args.batch_sizes if b <= 4] or [2], 8, 3
        args.gemm_tokens, args.repeats = [1, 8], 2
    return args


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    return 0 if result["all_matmuls_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

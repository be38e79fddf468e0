"""Batch-1 decode on SmolLM2: time per token and the share inside the linear layers, float32 vs int8 vs int4.

    python -m batchgen.bench.int_decode_breakdown

Forward hooks time the decoder's linear layers and lm_head around a SequenceRunner decode of one
sequence (64-token prompt, 8 steps, the faster of 2 passes); the rest is attention, norms, rotary,
embedding and sampling. The int8 / int4 models are the float model quantized as at load (the
default int_calibration, activation_aware: its pre-quant multiply is inside the linear layers' time).
"""

from __future__ import annotations

import copy
import time

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.loader.model_loader import load_model
from batchgen.engine.quant.calibrate.activation_aware import calibration_windows
from batchgen.engine.quant.calibrate.sequence_runner import SequenceRunner
from batchgen.engine.quant.int_model import quantize_model_int
from batchgen.engine.quant.weight_report import linear_layers
from batchgen.engine.text.tokenizer import Tokenizer

PROMPT_LEN = 64


def time_decode(model, num_steps: int = 8) -> tuple[float, float]:
    """(seconds per token, seconds per token inside the linear layers and lm_head), best of 2 passes."""
    spent = [0.0]
    hooks = []
    for layer in [*linear_layers(model).values(), model.lm_head]:
        hooks.append(layer.register_forward_pre_hook(lambda mod, args: setattr(mod, "_t0", time.perf_counter())))
        hooks.append(layer.register_forward_hook(
            lambda mod, args, out: spent.__setitem__(0, spent[0] + time.perf_counter() - mod._t0)))
    prompt = list(range(100, 100 + PROMPT_LEN))
    best = None
    for _ in range(2):
        runner = SequenceRunner(model, 1, PROMPT_LEN + num_steps)
        token = runner.forward([prompt], [0]).argmax(-1).tolist()
        spent[0] = 0.0
        start = time.perf_counter()
        for i in range(num_steps):
            token = runner.forward([[token[0]]], [PROMPT_LEN + i]).argmax(-1).tolist()
        total = time.perf_counter() - start
        if best is None or total < best[0] * num_steps:
            best = (total / num_steps, spent[0] / num_steps)
    for hook in hooks:
        hook.remove()
    return best


def main() -> None:
    torch.set_num_threads(2)
    cfg = EngineConfig(model="smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=512)
    loaded = load_model(cfg)
    windows = calibration_windows(Tokenizer(loaded.source), cfg.max_model_len, loaded.model_cfg.vocab_size)
    for name in ("float32", "int8", "int4"):
        model = loaded.model if name == "float32" else copy.deepcopy(loaded.model)
        if name != "float32":
            quantize_model_int(model, cfg, name, windows)
        per_token, linear = time_decode(model)
        print(f"{name}: {per_token * 1000:.1f} ms/token, linear layers {linear * 1000:.1f} ms "
              f"({linear / per_token:.0%}), rest {(per_token - linear) * 1000:.1f} ms", flush=True)


if __name__ == "__main__":
    main()

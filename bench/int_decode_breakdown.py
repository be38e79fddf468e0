"""Batch-1 decode on SmolLM2: time per token and the share inside the linear layers, float32 vs int8 vs int4.

    python bench/int_decode_breakdown.py

Forward hooks time the decoder's linear layers and lm_head around a DirectRunner decode of one
sequence (64-token prompt, 8 steps, the faster of 2 passes); the rest is attention, norms, rotary,
embedding and sampling. The int8 / int4 models are the float model quantized as at load (the
default int_calibration, activation_aware: its pre-quant multiply is inside the linear layers' time).
"""
import copy
import time

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.direct_runner import DirectRunner
from batchgen.engine.loader.model_loader import load_model
from batchgen.engine.quant.activation_aware import calibration_windows
from batchgen.engine.quant.int_model import quantize_model_int
from batchgen.engine.quant.weight_report import linear_layers
from batchgen.engine.tokenizer import Tokenizer

torch.set_num_threads(2)
cfg = EngineConfig(model="smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=512)
loaded = load_model(cfg)
base = loaded.model
windows = calibration_windows(Tokenizer(loaded.source), cfg.max_model_len, loaded.model_cfg.vocab_size)
def timed(model, steps=8):
    spent = [0.0]
    hooks = []
    for m in list(linear_layers(model).values()) + [model.lm_head]:
        hooks.append(m.register_forward_pre_hook(lambda mod, a: setattr(mod, "_t0", time.perf_counter())))
        hooks.append(m.register_forward_hook(lambda mod, a, o: spent.__setitem__(0, spent[0] + time.perf_counter() - mod._t0)))
    r = DirectRunner(model, 1, 64 + steps)
    tok = r.forward([list(range(100, 164))], [0]).argmax(-1).tolist()
    best = None
    for rep in range(2):
        spent[0] = 0.0; t = time.perf_counter(); ctx = 64
        for i in range(steps):
            tok = r.forward([[tok[0]]], [ctx + i]).argmax(-1).tolist()
        total = time.perf_counter() - t
        if best is None or total < best[0]: best = (total / steps, spent[0] / steps)
        r = DirectRunner(model, 1, 64 + steps); r.forward([list(range(100, 164))], [0])
    for h in hooks: h.remove()
    return best
for name in ("float32", "int8", "int4"):
    m = base if name == "float32" else copy.deepcopy(base)
    if name != "float32":
        quantize_model_int(m, cfg, name, windows)
    per_tok, lin = timed(m)
    print(f"{name}: {per_tok*1000:.1f} ms/token, linear layers {lin*1000:.1f} ms ({lin/per_tok:.0%}), rest {(per_tok-lin)*1000:.1f} ms", flush=True)

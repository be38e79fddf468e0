"""`batchgen bench --workload moe-layer`: one MoE block's forward on the CPU, batchgen's fused path against
transformers' own MoE block and a per-expert torch loop, on the same weights and tokens.

The block is a small Qwen3-MoE's (hidden 512, 16 experts, top 4, experts 512 channels wide: the issue's
benchmark model; `--engine` is not read). Timed for 1, 8, 64 and 256 tokens (a decode step of one
sequence, of 8, of 64; a prefill chunk):
- batchgen: layers/moe.py's SparseMoE as the engine runs it on this CPU: router, one stable sort, per
  expert segment two prepacked oneDNN GEMMs with SiLU * up in their epilogues (where oneDNN packs), one
  batched weighted combine;
- batchgen torch_mm: the same block unpacked (two torch.mm per expert segment into preallocated
  buffers, one activation pass over all rows): the path where oneDNN does not pack;
- HF eager: transformers' Qwen3MoeSparseMoeBlock with experts_implementation="eager" (a mask, gather,
  two projections, scale and index_add per expert that receives tokens);
- HF grouped_mm: the same block with transformers 5.x's default experts implementation (torch's
  grouped_mm where it dispatches, else eager);
- per-expert loop: the plain torch loop (nonzero, gather, project, index_add per expert).
Every output is checked against batchgen's (max relative difference printed) before any timing.
Each figure is the fastest of several calls (other jobs on a shared machine only ever add time).
"""

from __future__ import annotations

import copy
import time

import torch

from batchgen.kernels.fused_moe import silu_mul_rows

SHAPE = {"hidden_size": 512, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512}
TOKEN_COUNTS = (1, 8, 64, 256)
PEERS = ("batchgen_torch_mm", "hf_eager", "hf_grouped_mm", "per_expert_loop")


def seconds_per_call(fn, min_seconds: float = 0.3, max_calls: int = 200) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_seconds and len(times) < max_calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def per_expert_loop(x: torch.Tensor, gate: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int
                    ) -> torch.Tensor:
    """The plain loop in x's dtype: route (renormalised top k), then per expert its tokens through its two projections."""
    probs = torch.softmax((x @ gate.t()).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)  # norm_topk_prob, as the block benchmarked
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        if token.numel():
            y = silu_mul_rows(x[token] @ gate_up[expert].t()) @ down[expert].t()
            out.index_add_(0, token, y * weights[token, slot].unsqueeze(1).to(x.dtype))
    return out


def run_moe_layer(dtype_name: str = "float32", seed: int = 0) -> dict:
    """Milliseconds per forward of each path at each token count, and batchgen's speed-up over each."""
    import transformers

    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.models.layers.moe import SparseMoE
    from batchgen.engine.models.ops import cpu_kernel_ops, eager_ops
    from batchgen.kernels import cpu_elementwise

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": torch.float32}[dtype_name]
    torch.manual_seed(seed)
    hidden, num_experts, top_k, inter = (SHAPE[k] for k in ("hidden_size", "num_experts", "num_experts_per_tok",
                                                            "moe_intermediate_size"))
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k,
                                         moe_intermediate_size=inter, norm_topk_prob=True)
    blocks = {}
    for implementation in ("eager", "grouped_mm"):
        own = copy.deepcopy(config)  # the experts module reads its config's implementation at every call
        own._experts_implementation = implementation
        blocks[implementation] = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(own)
    with torch.no_grad():
        for param in blocks["eager"].parameters():
            param.normal_(0.0, 0.05)
        blocks["grouped_mm"].load_state_dict(blocks["eager"].state_dict())
    for block in blocks.values():
        block.to(dtype).eval()
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=1, hidden_size=hidden, intermediate_size=inter, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=hidden, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=1, tie_word_embeddings=False, num_experts=num_experts,
                      num_experts_per_tok=top_k, moe_intermediate_size=inter, moe_renormalize=True)
    ours = SparseMoE(cfg).to(dtype).eval()
    hf_state = blocks["eager"].state_dict()
    with torch.no_grad():
        ours.gate.weight.copy_(hf_state["gate.weight"])
        ours.experts.gate_up_proj.copy_(hf_state["experts.gate_up_proj"])
        ours.experts.down_proj.copy_(hf_state["experts.down_proj"])
    from batchgen.engine.models.cpu_linear import can_fuse_silu_mul, can_pack

    packed = None
    if can_pack(torch.device("cpu"), dtype):  # what the engine runs on this CPU
        packed = copy.deepcopy(ours)
        packed.experts.pack_for_onednn(can_fuse_silu_mul(dtype))
    use_c = dtype in (torch.float32, torch.bfloat16) and cpu_elementwise.is_available()
    ops = cpu_kernel_ops() if use_c else eager_ops()
    gate, gate_up, down = ours.gate.weight, ours.experts.gate_up_proj, ours.experts.down_proj

    rows = []
    with torch.no_grad():
        for num_tokens in TOKEN_COUNTS:
            x = torch.randn(num_tokens, hidden).to(dtype)
            paths = {"batchgen": lambda x=x: (packed or ours)(x, ops),
                     "batchgen_torch_mm": lambda x=x: ours(x, ops),
                     "hf_eager": lambda x=x: blocks["eager"](x.unsqueeze(0)),
                     "hf_grouped_mm": lambda x=x: blocks["grouped_mm"](x.unsqueeze(0)),
                     "per_expert_loop": lambda x=x: per_expert_loop(x, gate, gate_up, down, top_k)}
            reference = paths["batchgen"]().float()
            differences = {name: ((fn().reshape(num_tokens, hidden).float() - reference).abs().max()
                                  / reference.abs().max()).item() for name, fn in paths.items() if name != "batchgen"}
            ms = {name: 1e3 * seconds_per_call(fn) for name, fn in paths.items()}
            rows.append({"num_tokens": num_tokens, "ms": ms, "max_rel_difference": differences,
                         "speedup": {name: ms[name] / ms["batchgen"] for name in ms if name != "batchgen"}})
    return {"workload": "moe-layer", "dtype": str(dtype).removeprefix("torch."), "shape": SHAPE,
            "elementwise_ops": "c" if use_c else "eager", "experts_path": "onednn_packed" if packed else "torch_mm", "num_threads": torch.get_num_threads(), "runs": rows}


def format_moe_layer(result: dict) -> str:
    shape = result["shape"]
    lines = [f"batchgen bench: workload moe-layer ({result['dtype']}, hidden {shape['hidden_size']}, "
             f"{shape['num_experts']} experts top {shape['num_experts_per_tok']}, experts "
             f"{shape['moe_intermediate_size']} wide; {result['num_threads']} threads; ms per forward, "
             "batchgen's speed-up in brackets)",
             f"  batchgen: experts {result['experts_path']}; batchgen torch_mm: the grouped torch GEMMs "
             "(the path where oneDNN does not pack)",
             f"  {'tokens':>6} {'batchgen':>9} {'batchgen torch_mm':>18} {'HF eager':>18} {'HF grouped_mm':>18} "
             f"{'per-expert loop':>18}"]
    for r in result["runs"]:
        ms, up = r["ms"], r["speedup"]
        lines.append(f"  {r['num_tokens']:>6} {ms['batchgen']:>9.3f} "
                     + " ".join(f"{ms[k]:>9.3f} ({up[k]:5.2f}x)" for k in PEERS))
    worst = max(max(r["max_rel_difference"].values()) for r in result["runs"])
    lines.append(f"  outputs agree with batchgen's within a relative {worst:.1e}")
    return "\n".join(lines)

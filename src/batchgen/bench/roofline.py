"""Roofline arithmetic for a generation workload: how fast could the linear layers alone go?

Only the linear layers count (attention over the KV cache, norms and rotary are left out), so the
roofline is an upper bound on tokens/s at a given GEMM rate. Counting rules:
- every token the model runs forward (every prompt token and every fed-back decode token) goes
  through each layer's q/k/v, o, gate/up and down projections: 2 * in * out FLOPs per linear;
- in a mixture-of-experts layer a token runs the router and its top-k experts' gate/up and down
  (the active weights only: the other experts are resident but unread for that token), and the
  shared expert where the model has one;
- the lm_head runs only on rows whose token is sampled (the last prompt position, then each decode).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.models.config import ModelConfig


@dataclass(frozen=True)
class LinearShape:
    """One weight matrix of the model as the engine multiplies it: (tokens, in) @ (in, out)."""

    name: str  # as the bench reports it: the module name without "_proj" (qkv, o, gate_up, down, lm_head)
    in_features: int
    out_features: int
    count: int = 1  # how many times one token goes through this shape (an MoE layer's experts: top k)

    @property
    def num_flops_per_token(self) -> int:
        return 2 * self.in_features * self.out_features * self.count


def layer_linear_shapes(cfg: ModelConfig, layer_index: int | None = None) -> list[LinearShape]:
    """The linears of one decoder layer (ModelConfig.linear_shapes: q/k/v and gate/up fused). In an MoE
    model (layer_index None: its first MoE layer) the MLP's place holds the router and one expert's
    gate/up and down, counted top-k times, and the shared expert's where there is one."""
    shapes = [LinearShape(name.removesuffix("_proj"), in_features, out_features)
              for name, (out_features, in_features) in cfg.linear_shapes().items()]
    if layer_index is None:
        layer_index = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), 0)
    if not cfg.is_moe_layer(layer_index):
        return shapes
    hidden, inter, top_k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    moe = [LinearShape("router", hidden, cfg.num_experts),
           LinearShape("expert_gate_up", hidden, 2 * inter, top_k),
           LinearShape("expert_down", inter, hidden, top_k)]
    if cfg.shared_expert_intermediate_size:
        shared = cfg.shared_expert_intermediate_size
        moe += [LinearShape("shared_gate_up", hidden, 2 * shared), LinearShape("shared_down", shared, hidden)]
    return shapes[:2] + moe


def lm_head_shape(cfg: ModelConfig) -> LinearShape:
    out_features, in_features = cfg.lm_head_shape
    return LinearShape("lm_head", in_features, out_features)


def num_layer_flops_per_token(cfg: ModelConfig) -> int:
    """Linear-layer FLOPs of one token through all decoder layers (no lm_head; MoE: active weights)."""
    return sum(s.num_flops_per_token for i in range(cfg.num_layers) for s in layer_linear_shapes(cfg, i))


def num_lm_head_flops_per_token(cfg: ModelConfig) -> int:
    return lm_head_shape(cfg).num_flops_per_token


@dataclass(frozen=True)
class Roofline:
    """The workload's linear FLOPs and the time they take at `gemm_flops_per_s`."""

    num_forward_tokens: int
    num_sampled_tokens: int
    num_layer_flops: int
    num_lm_head_flops: int
    gemm_flops_per_s: float

    @property
    def num_flops(self) -> int:
        return self.num_layer_flops + self.num_lm_head_flops

    @property
    def seconds(self) -> float:
        return self.num_flops / self.gemm_flops_per_s

    @property
    def completion_tokens_per_s(self) -> float:
        return self.num_sampled_tokens / self.seconds

    def as_dict(self) -> dict:
        return {
            "num_forward_tokens": self.num_forward_tokens, "num_sampled_tokens": self.num_sampled_tokens,
            "num_layer_flops": self.num_layer_flops, "num_lm_head_flops": self.num_lm_head_flops,
            "num_flops": self.num_flops, "gemm_gflops_per_s": self.gemm_flops_per_s / 1e9,
            "seconds": self.seconds, "completion_tokens_per_s": self.completion_tokens_per_s,
        }


def workload_roofline(cfg: ModelConfig, prompt_lens: list[int], output_lens: list[int],
                      gemm_flops_per_s: float) -> Roofline:
    """Roofline of generating output_lens[i] tokens after a prompt of prompt_lens[i] tokens, no cache.

    A request runs prompt_len + output_len - 1 tokens forward (the last sampled token is never fed
    back) and samples output_len tokens.
    """
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(output_lens)} output lengths")
    num_forward = sum(p + o - 1 for p, o in zip(prompt_lens, output_lens))
    num_sampled = sum(output_lens)
    return Roofline(num_forward, num_sampled, num_forward * num_layer_flops_per_token(cfg),
                    num_sampled * num_lm_head_flops_per_token(cfg), gemm_flops_per_s)

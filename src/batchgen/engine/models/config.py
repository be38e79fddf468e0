"""ModelConfig: the architecture facts the engine needs, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    # OLMo 2: the q/k RMSNorm spans the whole q (and k) projection, weights q_size / kv_size wide
    qk_norm_over_heads: bool = False
    o_proj_bias: bool = False  # OLMo 2 with attention_bias: a bias on o_proj as well as on q/k/v
    # GLM-4: an RMSNorm on the attention output and on the MLP output too, before each residual add
    # (layers/sandwich_norm_decoder.py); two more hidden-size norm weights per layer.
    sandwich_norms: bool = False
    # Rope turns the first head_dim x this channels of each q/k head, the rest pass (GLM-4: 0.5,
    # Phi-4-mini: 0.75).
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False  # GLM-4: rope rotates pairs (2i, 2i + 1), not (i, i + rotary_dim / 2)
    # A query attends to the last this many positions only, itself included (None: all), in the layers
    # `layer_types` marks sliding (all of them when it is None).
    sliding_window: int | None = None
    # transformers' per-layer kinds: "sliding_attention" (within sliding_window) or "full_attention";
    # None: every layer is sliding when sliding_window is set (Mistral), else full.
    layer_types: tuple[str, ...] | None = None
    # gpt-oss: a learned logit per query head (`self_attn.sinks`) joins each attention softmax's denominator
    # and weighs no value (attention sinks)
    attention_sinks: bool = False
    attn_logit_softcapping: float | None = None  # Gemma 2: attention scores become c * tanh(score / c)
    final_logit_softcapping: float | None = None  # Gemma 2: logits become c * tanh(logit / c)
    query_pre_attn_scalar: float | None = None  # Gemma: the softmax scale is this ** -0.5 (None: head_dim's)
    rope_local_theta: float | None = None  # Gemma 3: the local (sliding) layers' rope base
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_pytorch_tanh (Gemma's GeGLU)
    # Mixture of experts (layers/moe.py): routed experts per MoE layer (0: a dense model), experts each
    # token runs, each expert's MLP channels (Mixtral: intermediate_size; Qwen3-MoE: moe_intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # How the router turns logits into weights: "softmax_topk" (softmax over all experts, then the top k:
    # Mixtral, Qwen3-MoE) or "topk_softmax" (the top k logits, then softmax over them: gpt-oss).
    moe_router: str = "softmax_topk"
    moe_renormalize: bool = False  # softmax_topk: the k weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    moe_router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    moe_expert_bias: bool = False  # biases on every expert's gate/up and down projections (gpt-oss)
    # How the routed experts' weights are stored: "" (the model dtype) or "mxfp4" (gpt-oss as published: blocks
    # of 32 4-bit values sharing an 8-bit scale, 17 bytes a block; read by `batchgen plan` only, kv/expert_bytes.py).
    moe_expert_format: str = ""
    # gpt-oss's clamped SwiGLU in place of SiLU(gate) * up (None: the plain one): gate clamped above at the limit,
    # up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate).
    moe_swiglu_limit: float | None = None
    moe_swiglu_alpha: float = 1.702
    # Layers that keep a dense MLP (intermediate_size wide) in an MoE model (Qwen3-MoE's mlp_only_layers and
    # decoder_sparse_step); the others hold the experts.
    moe_dense_layers: tuple[int, ...] = ()
    # A shared expert every token runs besides the routed ones, this many channels (0: none; Qwen2-MoE),
    # scaled by sigmoid(shared_expert_gate(x)).
    shared_expert_intermediate_size: int = 0
    rope_scaling: dict | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The HF `architectures` name models/registry.py runs it as; None (a config built in code): model_type's.
    architecture: str | None = None
    # A sequence classifier's (`*ForSequenceClassification`, layers/sequence_classifier.py): its score
    # head's labels (0: a causal LM) and the pad token its last-token pooling skips (config.json's).
    num_labels: int = 0
    pad_token_id: int | None = None
    label_names: tuple[str, ...] = ()  # config.json's id2label in id order (the server's /classify `label`)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether that decoder layer holds the experts (else a dense MLP)."""
        return self.is_moe and layer_index not in self.moe_dense_layers

    @property
    def rotary_dim(self) -> int:
        """The channels of each q/k head rope turns (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window of layer `layer_index`'s attention (None: it sees every earlier position)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_index] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        """The softmax scale: query_pre_attn_scalar ** -0.5 where the config sets it, else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of one decoder layer's linear layers, by module name.

        The orientation is torch's `nn.Linear.weight`: a layer maps (T, in) to (T, out) and holds an
        (out, in) weight. q/k/v and gate/up are fused, as the engine's modules hold them.
        """
        return {"qkv_proj": (self.q_size + 2 * self.kv_size, self.hidden_size),
                "o_proj": (self.hidden_size, self.q_size),
                "gate_up_proj": (2 * self.intermediate_size, self.hidden_size),
                "down_proj": (self.hidden_size, self.intermediate_size)}

    @property
    def lm_head_shape(self) -> tuple[int, int]:
        """(out_features, in_features) of lm_head: (vocab_size, hidden_size)."""
        return (self.vocab_size, self.hidden_size)

    @classmethod
    def from_hf_dict(cls, cfg: dict, is_plan_only: bool = False) -> ModelConfig:
        """From a parsed config.json: its architecture looked up in the registry (ValueError naming it
        when it is not registered), the keys every family shares, then what the family reads its own
        way (its class's `config_fields`). `is_plan_only` (`batchgen plan`): an architecture the engine
        does not run yet but whose shapes the planner reads (registry.PLAN_ONLY_ARCHITECTURES) is read too;
        loading such a config still refuses it by name."""
        # The registry imports the family files, which import this module for annotations only.
        from batchgen.engine.models.registry import ARCHITECTURES, PLAN_ONLY_ARCHITECTURES, hf_architecture
        from batchgen.engine.models.registry import architecture as registered

        names = cfg.get("architectures") or []
        plan_only = next((n for n in names if n in PLAN_ONLY_ARCHITECTURES), None) if is_plan_only else None
        if plan_only is not None and not any(n in ARCHITECTURES for n in names):
            architecture, family = plan_only, PLAN_ONLY_ARCHITECTURES[plan_only]
        else:
            architecture = hf_architecture(cfg)
            family = registered(architecture)
        model_type = cfg.get("model_type", family.model_type)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        partial_rotary_factor = cfg.get("partial_rotary_factor")
        params = cfg.get("rope_parameters")  # transformers >= 5 folds these into rope_parameters
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            partial_rotary_factor = partial_rotary_factor or params.get("partial_rotary_factor")
            if rope_scaling is None and params.get("rope_type", "default") != "default":
                rope_scaling = params
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        fields = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            partial_rotary_factor=float(partial_rotary_factor or 1.0),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=architecture,
        )
        return cls(**{**fields, **family.model_class.config_fields(cfg)})

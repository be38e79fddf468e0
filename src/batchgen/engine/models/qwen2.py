"""Qwen2 (Qwen2.5): the Llama decoder with a bias on q/k/v, and a sliding window in the layers its
config marks (Qwen3 reads the window the same way: `qwen_sliding_windows`)."""

from __future__ import annotations

from batchgen.engine.models.layers.causal_lm import CausalLM

LAYER_KINDS = ("sliding_attention", "full_attention")
# transformers' Qwen2Config / Qwen3Config defaults for a config.json without the keys.
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28


def qwen_sliding_windows(hf_config: dict, family: str) -> dict:
    """`sliding_window` and `layer_types` as HF's Qwen2Config / Qwen3Config read them: no window unless
    use_sliding_window; then config.json's layer_types, or (none written) layers from max_window_layers on
    are local. Most published checkpoints leave use_sliding_window false: no window anywhere."""
    if not hf_config.get("use_sliding_window", False):
        return {"sliding_window": None, "layer_types": None}
    window = hf_config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
    types = hf_config.get("layer_types")
    if types:
        unknown = set(types) - set(LAYER_KINDS)
        if unknown:
            raise ValueError(f"{family}: layer_types {sorted(unknown)} are not supported ({', '.join(LAYER_KINDS)})")
        return {"sliding_window": window, "layer_types": tuple(types)}
    first = hf_config.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
    kinds = tuple("sliding_attention" if window is not None and i >= first else "full_attention"
                  for i in range(hf_config["num_hidden_layers"]))
    return {"sliding_window": window, "layer_types": kinds}


class Qwen2ForCausalLM(CausalLM):
    """HF's Qwen2ForCausalLM: its q/k/v projections always have a bias, which config.json does not state."""

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        return {"attention_bias": bool(hf_config.get("attention_bias", True)),
                **qwen_sliding_windows(hf_config, cls.__name__)}

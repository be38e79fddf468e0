"""Model configs by shape alone (config.json dicts, no weights) for the capacity arithmetic tests."""

from __future__ import annotations

# Mistral-7B-v0.1's config.json: the classic worked example of KV-cache sizing.
MISTRAL_7B_SHAPE = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# Activations of one 4096-token step in bfloat16, per the activation_workspace_bytes formula: per token
# 2 x 4096 (residual, normed copy) + 4096 + 2 x 1024 (fused q/k/v) + 4096 (attention out) + 3 x 14336
# (gate/up and the activated half) = 61,440 values x 2 bytes x 4096 tokens.
MISTRAL_7B_STEP_ACTIVATION_BYTES = 61_440 * 2 * 4096
# float32 logits and their softmax per sampled sequence: 2 x 32000 x 4 bytes.
MISTRAL_7B_LOGITS_BYTES_PER_SEQ = 2 * 32000 * 4

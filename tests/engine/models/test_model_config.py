"""ModelConfig.linear_shapes: the one statement of the linear layers' shapes, against the loaded model."""

from __future__ import annotations

from batchgen.engine.models.config import ModelConfig

LLAMA3_8B = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)


def test_llama3_8b_shapes_are_out_by_in():
    assert LLAMA3_8B.linear_shapes() == {
        "qkv_proj": (4096 + 2 * 1024, 4096), "o_proj": (4096, 4096),
        "gate_up_proj": (2 * 14336, 4096), "down_proj": (4096, 14336)}
    assert LLAMA3_8B.lm_head_shape == (128256, 4096)


def test_shapes_match_every_layer_of_the_loaded_model(llm):
    model, cfg = llm.engine.runner.model, llm.engine.model_cfg
    shapes = cfg.linear_shapes()
    for i, layer in enumerate(model.layers):
        found = {name.rsplit(".", 1)[-1]: (m.out_features, m.in_features) for name, m in layer.named_modules()
                 if name.rsplit(".", 1)[-1] in shapes}
        assert found == shapes, i
    assert (model.lm_head.out_features, model.lm_head.in_features) == cfg.lm_head_shape

"""Writing a tiny HF model as a GGUF with the `gguf` package, the parts every family's writer shares."""

from __future__ import annotations


def new_gguf_writer(path, arch: str, cfg):
    """A GGUFWriter for `arch` holding the hyperparameters every llama-like family declares alike."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return writer


def finish_gguf(writer) -> None:
    """Header, key-values and tensors to the file, then closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

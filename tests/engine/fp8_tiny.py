"""A tiny random Llama written by HF transformers, with a word-level tokenizer, for FP8 checkpoint tests.

The tokenizer ("t0".."t255", split on spaces) is built in memory, so the folder loads in well under
a second and LLM(...) can run on it end to end.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
EOS_ID = 1


def write_tiny_llama(folder: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """Save a 2-layer GQA Llama (hidden 64) and its tokenizer into folder; returns (folder, HF model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="t0", eos_token=f"t{EOS_ID}",
                            bos_token="t2").save_pretrained(folder)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=EOS_ID, bos_token_id=2,
                         initializer_range=0.1)  # larger than HF's 0.02, so logits are not near-uniform
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return folder, model


def calibrate_input_scales(model: torch.nn.Module, token_ids: torch.Tensor) -> dict[str, float]:
    """Static activation scales the way calibration tools derive them: max |input| / 448 per linear layer."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            def record(mod, args, out, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        model(token_ids)
    for hook in hooks:
        hook.remove()
    return {name: value / 448.0 for name, value in amax.items()}

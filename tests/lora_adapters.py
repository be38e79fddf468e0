"""Tiny LoRA adapters made with peft on the bundled model in HF form, and peft's own outputs for them.

Each adapter has its own rank and targets; lora_B is non-zero (peft starts it at zero, which would make
every adapter the base model), drawn from a seeded generator. One uses rsLoRA (scale alpha / sqrt(r)).
"""

from __future__ import annotations

from pathlib import Path

import torch

ADAPTER_SPECS = {
    "A": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    "B": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
    "C": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "D": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def build_adapters(base_folder: Path, out_dir: Path, names=tuple(ADAPTER_SPECS)):
    """A PeftModel over a fresh copy of the base holding every adapter in `names` (peft's reference), and
    each adapter saved as a PEFT folder: (peft model, {name: folder})."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(45)
    model = None
    for name in names:
        config = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", init_lora_weights=False,
                            **ADAPTER_SPECS[name])
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name in names:
                if hasattr(module, "lora_A") and name in module.lora_A:
                    a, b = module.lora_A[name].weight, module.lora_B[name].weight  # (r, in), (out, r)
                    a.copy_(torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5)
                    b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
    folders = {}
    for name in names:
        model.save_pretrained(str(out_dir), selected_adapters=[name])
        folders[name] = out_dir / name
        assert (folders[name] / "adapter_model.safetensors").is_file()
    model.eval()
    return model, folders


@torch.no_grad()
def peft_greedy(peft_model, adapter: str | None, prompts: list[list[int]], max_new_tokens: int,
                eos_token_ids: tuple[int, ...], pad_token_id: int) -> list[list[int]]:
    """peft's greedy continuations with `adapter` active (None: the base, adapters disabled)."""
    from tests.engine.helpers import hf_greedy

    if adapter is None:
        with peft_model.disable_adapter():
            return hf_greedy(peft_model, prompts, max_new_tokens, eos_token_ids, pad_token_id)
    peft_model.set_adapter(adapter)
    return hf_greedy(peft_model, prompts, max_new_tokens, eos_token_ids, pad_token_id)


@torch.no_grad()
def peft_prompt_logprobs(peft_model, adapter: str | None, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1 under peft with `adapter` (None: the base)."""
    def run():
        logits = peft_model(torch.tensor([prompt])).logits[0].float()  # (L, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    if adapter is None:
        with peft_model.disable_adapter():
            return run()
    peft_model.set_adapter(adapter)
    return run()

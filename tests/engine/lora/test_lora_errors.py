"""Adapters that cannot run over the model fail when their request is added, naming the adapter and key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.engine import LoRARequest
from batchgen.engine.lora import LoRAError, read_peft_adapter

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _edited_copy(folder, tmp_path, edit_tensors=None, edit_config=None):
    copy = tmp_path / "adapter"
    shutil.copytree(folder, copy)
    if edit_tensors is not None:
        tensors = load_file(str(copy / "adapter_model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(copy / "adapter_model.safetensors"))
    if edit_config is not None:
        config = json.loads((copy / "adapter_config.json").read_text())
        edit_config(config)
        (copy / "adapter_config.json").write_text(json.dumps(config))
    return LoRARequest("bad", 99, str(copy))


def test_rank_over_max_lora_rank_names_adapter_and_key(lora_llm, lora_requests):
    with pytest.raises(LoRAError, match=r"'C'.*key 'model.layers.0.self_attn.k_proj' has rank 16, over max_lora_rank 8"):
        read_peft_adapter(lora_requests["C"], lora_llm.engine.loaded.model, max_lora_rank=8)


def test_unsupported_target_names_the_key(lora_llm, lora_adapters, tmp_path):
    def to_lm_head(tensors):
        tensors["base_model.model.lm_head.lora_A.weight"] = tensors.pop(Q_A)
        tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(49152, 8)
        del tensors[Q_B]
    request = _edited_copy(lora_adapters[1]["A"], tmp_path, to_lm_head)
    with pytest.raises(LoRAError, match=r"'bad'.*'lm_head'.*supported targets are q_proj"):
        lora_llm.generate("Hi", lora_request=request)


def test_base_mismatch_in_shapes_names_the_key(lora_llm, lora_adapters, tmp_path):
    def narrower(tensors):
        tensors[Q_A] = tensors[Q_A][:, :100].contiguous()
    request = _edited_copy(lora_adapters[1]["A"], tmp_path, narrower,
                           lambda c: c.update(base_model_name_or_path="some/other-model"))
    with pytest.raises(LoRAError, match=r"'bad'.*layers\.0\.self_attn\.q_proj.*another base model.*some/other-model"):
        lora_llm.generate("Hi", lora_request=request)


def test_unsupported_config_and_conflicting_ids(lora_llm, lora_adapters, lora_requests, tmp_path):
    request = _edited_copy(lora_adapters[1]["A"], tmp_path, edit_config=lambda c: c.update(use_dora=True))
    with pytest.raises(LoRAError, match="'bad'.*use_dora"):
        lora_llm.generate("Hi", lora_request=request)
    same_id = LoRARequest("other", lora_requests["A"].lora_int_id, str(lora_adapters[1]["B"]))
    lora_llm.generate("Hi", lora_request=lora_requests["A"])
    with pytest.raises(LoRAError, match="already names adapter 'A'"):
        lora_llm.generate("Hi", lora_request=same_id)
    assert not lora_llm.engine.has_unfinished()


def test_engine_without_enable_lora_refuses_adapters(llm, lora_requests):
    with pytest.raises(ValueError, match="without enable_lora"):
        llm.generate("Hi", lora_request=lora_requests["A"])

"""LoRARequest: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`LoRARequest("sql", 1, "/adapters/sql")`: the adapter `lora_name`, known to the engine by
    `lora_int_id` (>= 1; the same id must always name the same folder), read from `lora_path` (a PEFT
    folder: adapter_config.json + adapter_model.safetensors, or a Hugging Face repo id found in the
    local cache). `base_model_name` is vLLM's optional field: the model the adapter was trained on,
    for display."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string; got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1; "
                             f"got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is empty")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of lora_int_id."""
        return self.lora_int_id

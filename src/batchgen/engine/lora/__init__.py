"""LoRA adapters over one base model (vLLM's multi-LoRA): PEFT folders read and checked
(peft_adapter.py), the projections that add a step's adapters to their outputs (layers.py), the
adapters' host cache and device slots (manager.py), and merging one adapter into the weights (merge.py)."""

from batchgen.engine.lora.manager import LoRAManager
from batchgen.engine.lora.peft_adapter import LoRAAdapter, LoRAError, read_peft_adapter
from batchgen.engine.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAError", "LoRAManager", "LoRARequest", "read_peft_adapter"]

"""LoRAManager: the engine's adapters, from disk to host memory to the device slots a step runs.

Three levels, as vLLM keeps them: every LoRARequest seen (id -> name and path; an id always names the
same folder), up to `max_cpu_loras` adapters read into host memory (least recently used evicted, read
again when a request asks for it), and `max_loras` device slots of stacked weights in every LoRALinear.
The scheduler admits at most max_loras distinct adapters per step, so a step's adapters always fit the
slots; `prepare_step` puts each in a slot (evicting the least recently used slot no adapter of the step
holds) and packs the step's token -> slot mapping into the step's one host-to-device copy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from batchgen.engine.lora.layers import LoRAStepMapping, LoRAStepState, wrap_lora_modules
from batchgen.engine.lora.peft_adapter import LoRAAdapter, LoRAError, read_peft_adapter
from batchgen.engine.lora.request import LoRARequest
from batchgen.engine.runner.step_inputs import StepPacker, int_section


@dataclass
class LoRASections:
    """The step's adapter tokens grouped by slot (LoRAStepMapping), sent with the step's inputs."""

    token_order: list[int] = int_section()  # (T',)
    seg_starts: list[int] = int_section()  # (S + 1,)
    seg_slots: list[int] = int_section()  # (S,)


@dataclass
class LoRAStats:
    num_adapter_reads: int = 0  # adapters read from disk into host memory (first use and after eviction)
    num_host_evictions: int = 0  # adapters dropped from host memory (over max_cpu_loras)
    num_slot_loads: int = 0  # adapters copied into a device slot
    num_lora_tokens: int = 0  # tokens run with an adapter
    adapters: dict = field(default_factory=dict)  # name -> tokens run with it


class LoRAManager:
    """Owns the adapters of one engine over one model (wrapped in place at construction)."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, base_model_name: str | None = None):
        self.model = model
        model.lora_owner = self  # an engine sharing these weights later takes the layers over (wrap_lora_modules)
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.base_model_name = base_model_name
        self.state = LoRAStepState(use_triton=device.type == "cuda" and _has_triton())
        self.layers = wrap_lora_modules(model, max_loras, max_lora_rank, self.state, dtype, device)
        self.requests: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id per device slot
        self.slot_use: list[int] = [0] * max_loras  # step counter of each slot's last use (LRU)
        self.num_steps = 0
        self.stats = LoRAStats()
        self._mapping_parts: tuple | None = None  # the packed step's host segments, until its tensors come

    # ---- adapters ---------------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Register `request` and read it now (LoRAError naming the adapter and key when it cannot run
        over this model): a bad adapter fails when its request is added, not in a later step."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
            raise LoRAError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                            f"({known.lora_path}); LoRARequest {request.lora_name!r} ({request.lora_path}) "
                            "needs an id of its own")
        for other in self.requests.values():
            if other.lora_name == request.lora_name and other.lora_int_id != request.lora_int_id:
                raise LoRAError(f"adapter name {request.lora_name!r} is already lora_int_id {other.lora_int_id}")
        self.requests[request.lora_int_id] = request
        try:
            return self.adapter(request.lora_int_id)
        except BaseException:
            if known is None:
                del self.requests[request.lora_int_id]
            raise

    def adapter(self, lora_int_id: int) -> LoRAAdapter:
        """The adapter in host memory, read from its folder when it is not (evicting the least recently
        used beyond max_cpu_loras)."""
        adapter = self.host.get(lora_int_id)
        if adapter is not None:
            self.host.move_to_end(lora_int_id)
            return adapter
        adapter = read_peft_adapter(self.requests[lora_int_id], self.model, self.max_lora_rank, self.base_model_name)
        self.stats.num_adapter_reads += 1
        self.host[lora_int_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
            self.stats.num_host_evictions += 1
        return adapter

    def _slot_for(self, lora_int_id: int, taken: set[int]) -> int:
        """The device slot holding the adapter, loading it into the least recently used slot that no
        other adapter of this step holds."""
        if lora_int_id in self.slots:
            return self.slots.index(lora_int_id)
        free = [s for s in range(self.max_loras) if s not in taken]
        if not free:
            raise RuntimeError(f"a step asks for more than max_loras = {self.max_loras} adapters")
        slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_use[s]))
        adapter = self.adapter(lora_int_id)
        for name, layer in self.layers.items():
            layer.install(slot, adapter.weights.get(name))
        self.slots[slot] = lora_int_id
        self.stats.num_slot_loads += 1
        return slot

    def _take_layers_back(self) -> None:
        """Another engine sharing these weights (with_engine_settings) put its own LoRA layers in the
        model since this one's last adapter step: put this engine's back (same base layers, its slots)."""
        for name, layer in self.layers.items():
            parent, child = name.rsplit(".", 1)
            setattr(self.model.get_submodule(parent), child, layer)
        self.model.lora_owner = self

    # ---- steps ------------------------------------------------------------------------------------
    def add_step_sections(self, packer: StepPacker, lora_ids: list[int], num_tokens: list[int]) -> None:
        """Slots for the step's adapters, and its LoRASections packed: `lora_ids[i]` is the i-th sequence
        of the flat batch's adapter (0: the base), `num_tokens[i]` its tokens in the batch."""
        self.num_steps += 1
        if any(lora_ids) and getattr(self.model, "lora_owner", None) is not self:
            self._take_layers_back()
        if not any(lora_ids):
            self._mapping_parts = None
            return
        taken: set[int] = set()
        slot_of: dict[int, int] = {}
        for lora_int_id in dict.fromkeys(i for i in lora_ids if i):
            slot = self._slot_for(lora_int_id, taken)
            slot_of[lora_int_id] = slot
            taken.add(slot)
            self.slot_use[slot] = self.num_steps
        by_slot: dict[int, list[tuple[int, int]]] = {}  # slot -> runs (start, end) of the flat batch
        start = 0
        for lora_int_id, n in zip(lora_ids, num_tokens):
            if lora_int_id:
                runs = by_slot.setdefault(slot_of[lora_int_id], [])
                if runs and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], start + n)
                else:
                    runs.append((start, start + n))
                name = self.requests[lora_int_id].lora_name
                self.stats.adapters[name] = self.stats.adapters.get(name, 0) + n
                self.stats.num_lora_tokens += n
            start += n
        sections = LoRASections()
        segments, contiguous = [], []
        for slot in sorted(by_slot):
            first = len(sections.token_order)
            for run_start, run_end in by_slot[slot]:
                sections.token_order.extend(range(run_start, run_end))
            segments.append((slot, first, len(sections.token_order)))
            sections.seg_starts.append(first)
            sections.seg_slots.append(slot)
            runs = by_slot[slot]
            contiguous.append(slice(runs[0][0], runs[0][1]) if len(runs) == 1 else None)
        sections.seg_starts.append(len(sections.token_order))
        packer.add_sections(sections, "l.")
        self._mapping_parts = (segments, contiguous)

    def mapping(self, tensors: dict[str, torch.Tensor]) -> LoRAStepMapping | None:
        """The packed step's mapping from its device tensors (None: no adapter token in the step)."""
        if self._mapping_parts is None:
            return None
        segments, contiguous = self._mapping_parts
        self._mapping_parts = None
        token_order = tensors["l.token_order"]
        rows = []
        for (_, first, end), run in zip(segments, contiguous):
            rows.append(run if run is not None else token_order[first:end].long())
        return LoRAStepMapping(segments, token_order, tensors["l.seg_starts"], tensors["l.seg_slots"], rows,
                               max(end - first for _, first, end in segments))

    def report(self) -> dict:
        """The counters (engine stats' `lora`)."""
        s = self.stats
        return {"num_adapter_reads": s.num_adapter_reads, "num_host_evictions": s.num_host_evictions,
                "num_slot_loads": s.num_slot_loads, "num_lora_tokens": s.num_lora_tokens,
                "tokens_by_adapter": dict(s.adapters), "in_host_memory": len(self.host),
                "max_loras": self.max_loras, "max_cpu_loras": self.max_cpu_loras}


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

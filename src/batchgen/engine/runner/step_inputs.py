"""One engine step's inputs, packed on the host into one buffer and sent to the device with one copy.

Every per-step tensor the model, the attention backend and the sampler read (token ids, positions,
KV slots, query offsets, sequence and context lengths, block tables, sampling parameters) is a named
section of one int32 host buffer; float32 sections are stored bit for bit in the same buffer. The
buffer is pinned when the step runs on a CUDA device, so the one `.to(device, non_blocking=True)` is
an asynchronous DMA; the device tensors are views of the copy (`view(torch.float32)` for the float
sections). The buffer is reused from step to step: it is rewritten only after the previous step's
sampled tokens came back, which waits for the stream and so for the previous copy too. (With async
scheduling a step is packed before the previous one is read back: the runner then packs into two
buffers in turn, model_runner.py.)

On the CPU the "copy" is skipped and the views point into the host buffer itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from batchgen.engine.core.scheduler import ScheduledSeq


class HostBuffer:
    """A growable int32 host buffer (pinned for CUDA steps) with int32 and float32 numpy views."""

    def __init__(self, pin: bool, size: int = 1 << 14):
        self.pin = pin
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        self.tensor = torch.empty(size, dtype=torch.int32, pin_memory=self.pin)  # (size,)
        self.ints = self.tensor.numpy()
        self.floats = self.ints.view(np.float32)

    def reserve(self, size: int) -> None:
        """At least `size` int32 elements (contents are not kept)."""
        if size > self.tensor.numel():
            self._allocate(max(size, 2 * self.tensor.numel()))


def should_pin(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def int_section():
    """A field of a section dataclass: a list of int32 values, one section of the step's buffer."""
    return field(default_factory=list)


def float_section():
    """A field of a section dataclass: a list of float32 values (stored bit for bit in the int32 buffer)."""
    return field(default_factory=list, metadata={"is_float": True})


class StepPacker:
    """Collects a step's named sections, then writes them into the host buffer and sends it in one copy.

    Sections are declared once, as the fields of a dataclass (`int_section` / `float_section`), and
    added together with `add_sections`; `send()` returns the device tensors by field name (prefixed),
    int32 or float32, shaped as given.
    """

    def __init__(self, device: torch.device, buffer: HostBuffer | None = None):
        self.device = device
        self.buffer = buffer if buffer is not None else HostBuffer(should_pin(device))
        self._sections: list[tuple[str, object, bool, tuple[int, ...] | None]] = []
        self._size = 0
        self.sent: torch.Tensor | None = None  # the last step's whole buffer, as sent (device, or host on the CPU)

    def add_sections(self, sections, prefix: str = "", shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        """Every field of the dataclass `sections` (a list or numpy array of values) as the section
        `prefix + field name`; `shapes`: the device view's shape of some of them."""
        shapes = shapes or {}
        for f in dataclasses.fields(sections):
            values = getattr(sections, f.name)
            self._sections.append((prefix + f.name, values, f.metadata.get("is_float", False), shapes.get(f.name)))
            self._size += len(values)

    def send(self) -> dict[str, torch.Tensor]:
        buffer = self.buffer
        buffer.reserve(max(self._size, 1))
        offsets = []
        offset = 0
        for _name, values, is_float, _shape in self._sections:
            n = len(values)
            if n:
                (buffer.floats if is_float else buffer.ints)[offset:offset + n] = values
            offsets.append(offset)
            offset += n
        host = buffer.tensor[:offset]
        if self.device.type == "cpu":
            device_buffer = host
        else:  # the step's one host-to-device copy
            device_buffer = host.to(self.device, non_blocking=buffer.pin)
        self.sent = device_buffer
        tensors = {}
        for (name, values, is_float, shape), start in zip(self._sections, offsets):
            t = device_buffer[start:start + len(values)]
            if is_float:
                t = t.view(torch.float32)
            if shape is not None:
                t = t.view(shape)
            tensors[name] = t
        self._sections, self._size = [], 0
        return tensors


@dataclass
class ModelSections:
    """The model's and the attention backend's per-step inputs (sequence order: decodes, then chunks)."""

    input_ids: list[int] = int_section()  # (T,)
    positions: list[int] = int_section()  # (T,)
    slot_mapping: list[int] = int_section()  # (T,)
    logits_indices: list[int] = int_section()  # (N,)
    query_start_loc: list[int] = int_section()  # (S + 1,)
    seq_lens: list[int] = int_section()  # (S,)
    context_lens: list[int] = int_section()  # (S,)
    query_lens: list[int] = int_section()  # (S,)
    block_tables: list[int] = int_section()  # (S * W,) flat, padded with block 0


def model_section_sizes(num_tokens: int, num_logits: int, num_seqs: int, table_width: int) -> dict[str, int]:
    """The length of each ModelSections field in a step of T tokens, N logits rows and S sequences whose
    block tables are W wide: what a tensor-parallel worker needs to unpack rank 0's copy of them."""
    return {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens, "logits_indices": num_logits,
            "query_start_loc": num_seqs + 1, "seq_lens": num_seqs, "context_lens": num_seqs, "query_lens": num_seqs,
            "block_tables": num_seqs * table_width}


def unpack_model_sections(buffer: torch.Tensor, num_tokens: int, num_logits: int, num_seqs: int,
                          table_width: int) -> dict[str, torch.Tensor]:
    """Views of a step's ModelSections in `buffer` (int32, a copy of the start of the step's buffer:
    add_step_sections packs them first), by name and shaped as StepPacker.send gives them."""
    sizes = model_section_sizes(num_tokens, num_logits, num_seqs, table_width)
    tensors, offset = {}, 0
    for f in dataclasses.fields(ModelSections):
        t = buffer[offset:offset + sizes[f.name]]
        tensors[f.name] = t.view(torch.float32) if f.metadata.get("is_float", False) else t
        offset += sizes[f.name]
    tensors["block_tables"] = tensors["block_tables"].view(num_seqs, table_width)
    return tensors


@dataclass
class BlockCopySections:
    """KV blocks copied before the step's forward (copy on write of a block shared with a fork), sent only
    when there are any."""

    copy_src: list[int] = int_section()  # (C,) source block ids
    copy_dst: list[int] = int_section()  # (C,) destination block ids


@dataclass
class StepInputs:
    """A step's flat batch: host-side lengths (what the scheduler decided) and the device tensors.

    Sequence order: the first `num_decodes` sequences are decodes (one token each), then prefill
    chunks; a sequence's tokens are contiguous in the flat batch.
    """

    # ---- host side
    query_lens: list[int]  # (S,) new tokens per sequence
    context_lens: list[int]  # (S,) tokens cached before this step
    block_tables: list[list[int]]  # (S, *) each sequence's blocks covering context + query
    num_decodes: int
    max_seq_len: int  # longest context + query of the step
    block_size: int
    # ---- device side (int32 unless noted)
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token (-1: write nothing; padding rows)
    logits_indices: torch.Tensor  # (N,) flat tokens whose logits are sampled: one per sampling sequence,
    # 1 + k for a verify chunk (speculative decoding)
    query_start_loc: torch.Tensor  # (S + 1,) cumulative query lengths, [0] = 0, [S] = T
    seq_lens: torch.Tensor  # (S,) context + query: keys each sequence sees after this step's KV store
    context_lens_t: torch.Tensor  # (S,)
    query_lens_t: torch.Tensor  # (S,)
    block_tables_t: torch.Tensor  # (S, W) padded with block 0 (never read past a sequence's seq_len)
    tensors: dict[str, torch.Tensor]  # every section by name, the sampler's included
    lora: object | None = None  # LoRA adapters: the step's LoRAStepMapping (engine/lora/), None: base only

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == len(self.query_lens)


def add_step_sections(packer: StepPacker, order: list[ScheduledSeq], num_decodes: int,
                      block_size: int) -> tuple[list[int], list[int], list[list[int]], int, list[ScheduledSeq]]:
    """Pack the model and attention inputs of `order` (its first `num_decodes` are decodes). Returns
    the host-side (query_lens, context_lens, block_tables, max_seq_len, sampling sequences); a
    sampling verify chunk has `num_sampled` (1 + k) logits rows, the others one.

    Decodes, most of a step at large batch, take list comprehensions (no per-token loop); block
    tables are padded into one flat list with zeros (block 0 is never read past a seq_len)."""
    bs = block_size
    decodes = order[:num_decodes]
    seqs = [s.seq for s in decodes]
    positions = [seq.num_computed_tokens for seq in seqs]
    input_ids = [seq.token_ids[pos] for seq, pos in zip(seqs, positions)]
    slots = [seq.block_ids[pos // bs] * bs + pos % bs for seq, pos in zip(seqs, positions)]
    seq_lens = [pos + 1 for pos in positions]
    context_lens = list(positions)
    query_lens = [1] * num_decodes
    query_start = list(range(num_decodes + 1))
    tables = [seq.block_ids for seq in seqs]
    # A decode samples unless it recomputes a token it already has (a preempted sequence's last one) or
    # its sequence samples nothing (the last prompt token of a prompt-only sequence).
    if all(n == len(seq.token_ids) and not seq.is_prompt_only for n, seq in zip(seq_lens, seqs)):
        logits_indices = list(range(num_decodes))
        sampling = list(decodes)
    else:
        logits_indices = [i for i, (n, seq) in enumerate(zip(seq_lens, seqs))
                          if n == len(seq.token_ids) and not seq.is_prompt_only]
        sampling = [decodes[i] for i in logits_indices]
    for s in order[num_decodes:]:
        seq = s.seq
        start = seq.num_computed_tokens
        end = start + s.num_new_tokens
        table = seq.block_ids
        input_ids.extend(s.input_token_ids())  # a verify chunk: the last token, then its drafts
        positions.extend(range(start, end))
        slots.extend([table[pos // bs] * bs + pos % bs for pos in range(start, end)])
        total = query_start[-1] + s.num_new_tokens
        query_start.append(total)
        num_sampled = s.num_sampled  # the chunk reaches the last known token (or draft): it samples
        if num_sampled:
            logits_indices.extend(range(total - num_sampled, total))  # a verify chunk: each of its 1 + k
            sampling.append(s)
        seq_lens.append(end)
        context_lens.append(start)
        query_lens.append(s.num_new_tokens)
        tables.append(table)
    # Each table cut to the blocks its seq_len covers (a table may hold blocks for later tokens).
    needed = [(n + bs - 1) // bs for n in seq_lens]
    tables = [t if len(t) == k else t[:k] for t, k in zip(tables, needed)]
    width = max(needed, default=0)
    zeros = [0] * width
    flat: list[int] = []
    for table in tables:
        flat += table
        if len(table) < width:
            flat += zeros[:width - len(table)]
    sections = ModelSections(input_ids, positions, slots, logits_indices, query_start, seq_lens, context_lens,
                             query_lens, flat)
    packer.add_sections(sections, shapes={"block_tables": (len(tables), width)})
    return query_lens, context_lens, tables, max(seq_lens, default=0), sampling


@dataclass
class LocalTableSections:
    """The sliding-window layers' own block group (kv/window_groups.py): the new tokens' slots in the local
    caches and the local block tables, laid out as ModelSections' slot_mapping and block_tables."""

    slot_mapping: list[int] = int_section()  # (T,)
    block_tables: list[int] = int_section()  # (S * W,) flat, padded with block 0 (freed entries hold 0 too)


def add_local_table_sections(packer: StepPacker, order: list[ScheduledSeq], block_size: int,
                             width: int) -> list[list[int]]:
    """Pack the local group's slots and tables of `order` (as add_step_sections packed the full group's, the
    same width); sent as "w.slot_mapping" / "w.block_tables". Returns the host tables."""
    bs = block_size
    slots: list[int] = []
    tables: list[list[int]] = []
    for s in order:
        seq = s.seq
        table = seq.local_block_ids
        start = seq.num_computed_tokens
        end = start + s.num_new_tokens
        slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
        tables.append(table[:(end + bs - 1) // bs])
    flat: list[int] = []
    for table in tables:
        flat += table + [0] * (width - len(table))
    packer.add_sections(LocalTableSections(slots, flat), "w.", shapes={"block_tables": (len(tables), width)})
    return tables


def make_step_inputs(tensors: dict[str, torch.Tensor], query_lens: list[int], context_lens: list[int],
                     block_tables: list[list[int]], num_decodes: int, max_seq_len: int,
                     block_size: int) -> StepInputs:
    return StepInputs(
        query_lens=query_lens, context_lens=context_lens, block_tables=block_tables, num_decodes=num_decodes,
        max_seq_len=max_seq_len, block_size=block_size,
        input_ids=tensors["input_ids"], positions=tensors["positions"], slot_mapping=tensors["slot_mapping"],
        logits_indices=tensors["logits_indices"], query_start_loc=tensors["query_start_loc"],
        seq_lens=tensors["seq_lens"], context_lens_t=tensors["context_lens"], query_lens_t=tensors["query_lens"],
        block_tables_t=tensors["block_tables"], tensors=tensors)

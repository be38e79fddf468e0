"""A tiny random Llama and a plain-torch attention backend that read only a step's packed tensors.

The backend does what a GPU backend must: it builds its metadata from StepInputs' device tensors
alone (no host list, no copy, no sync), skips slot -1 and attends through the block tables. Being
torch ops only, it runs on the `meta` device (transfer counting) and on the CPU (graph padding).
Slot writes from padding rows go to a scratch position, so tests keep block 0 for padding only.
"""

from __future__ import annotations

import dataclasses

import torch

from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder
from batchgen.engine.capabilities import Capabilities
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.loader.model_loader import build_empty_model
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.layers.rotary import RotaryEmbedding
from batchgen.engine.runner.model_runner import ModelRunner
from batchgen.engine.sampling.sampling_params import SamplingParams

VOCAB = 96
EOS = 95
BLOCK = 16
TINY = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=256, tie_word_embeddings=False)


@dataclasses.dataclass
class TorchStepMetadata(AttentionMetadata):
    seq_index: torch.Tensor | None = None  # (T,) sequence of each token
    key_limit: torch.Tensor | None = None  # (T,) keys each token sees
    block_tables: torch.Tensor | None = None  # (S, W)
    block_size: int = BLOCK


class TorchStepBuilder(AttentionMetadataBuilder):
    def build(self, *args):
        raise AssertionError("a GPU-style backend builds from the packed step only")

    def build_packed(self, step) -> TorchStepMetadata:
        num_seqs, num_tokens = step.num_seqs, step.num_tokens
        seq_index = torch.repeat_interleave(torch.arange(num_seqs, device=step.seq_lens.device),
                                            step.query_lens_t, output_size=num_tokens)  # (T,)
        offset = torch.arange(num_tokens, device=seq_index.device) - step.query_start_loc[seq_index]
        key_limit = step.context_lens_t[seq_index] + offset + 1
        return TorchStepMetadata(step.slot_mapping, step.num_decodes, seq_index, key_limit,
                                 step.block_tables_t, step.block_size)


class TorchStepAttention(AttentionBackend):
    name = "torch-step"

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim):
        return None

    def make_metadata_builder(self, num_layers, num_slots, block_size, dtype, device):
        return TorchStepBuilder()

    def forward(self, layer_index, q, k, v, kv_cache, meta: TorchStepMetadata):
        k_cache, v_cache = kv_cache
        slots = meta.slot_mapping.long()
        scratch = k_cache.shape[0] - 1  # padding rows (slot -1) write the last slot, never read by tests
        slots = torch.where(slots >= 0, slots, torch.full_like(slots, scratch))
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        tables = meta.block_tables[meta.seq_index].long()  # (T, W)
        bs = meta.block_size
        positions = torch.arange(tables.shape[1] * bs, device=q.device)  # (L,)
        key_slots = tables[:, positions // bs] * bs + positions % bs  # (T, L)
        group = q.shape[1] // k_cache.shape[1]
        keys = k_cache[key_slots].repeat_interleave(group, dim=2)  # (T, L, H, D)
        values = v_cache[key_slots].repeat_interleave(group, dim=2)
        scores = torch.einsum("thd,tlhd->thl", q, keys) * self.scale
        visible = positions[None, :] < meta.key_limit[:, None]  # (T, L)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        return torch.einsum("thl,tlhd->thd", scores.softmax(-1), values)


def tiny_runner(device: torch.device, num_blocks: int = 32, max_num_seqs: int = 16, seed: int = 0,
                monkeypatch=None, backend_class: type[AttentionBackend] | None = None, **settings) -> ModelRunner:
    """A ModelRunner over the tiny model on `device` (meta or cpu), with the torch-step backend
    unless `backend_class` names another; `settings`: more EngineConfig fields."""
    backend = (backend_class or TorchStepAttention)(TINY.num_heads, TINY.num_kv_heads, TINY.head_dim)
    model = build_empty_model(TINY, 256, backend, device, torch.float32)
    if device.type != "meta":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.3)
    model.rotary = RotaryEmbedding(TINY.head_dim, 256, TINY.rope_theta, None).to(device)
    model.eval()
    config = EngineConfig(model="tiny", dtype="float32", device="cpu", block_size=BLOCK, max_num_seqs=max_num_seqs,
                          **settings)
    if monkeypatch is not None and device.type != "cpu":
        monkeypatch.setattr(EngineConfig, "torch_device", property(lambda self: device))
    capabilities = Capabilities(device=device.type, attention_backend=backend.name, elementwise_ops="eager",
                                is_c_sampling=False, is_onednn_packed_linear=False, is_onednn_silu_mul=False,
                                has_triton=False, has_fp8_matmul=False, fp8_mode=None, is_triton_fp8_w8a16=False)
    return ModelRunner(config, TINY, model, num_blocks, (EOS,), capabilities)


def make_seq(request_id: str, prompt: list[int], params: SamplingParams, first_block: int) -> Sequence:
    """A sequence whose blocks are consecutive from `first_block` (enough for 64 tokens)."""
    seq = Sequence(request_id, 0, list(prompt), params, 0.0, 256)
    seq.block_ids = list(range(first_block, first_block + 4))
    return seq


def advance(results) -> None:
    """What the engine does after a step: the chunk is computed, the sampled token appended."""
    for r in results:
        r.scheduled.seq.num_computed_tokens += r.scheduled.num_new_tokens
        r.scheduled.seq.append_token(r.token_id, r.logprob, r.top_logprobs)


def prefill(seqs: list[Sequence]) -> list[ScheduledSeq]:
    return [ScheduledSeq(seq, seq.num_tokens - seq.num_computed_tokens) for seq in seqs]


def decode(seqs: list[Sequence]) -> list[ScheduledSeq]:
    return [ScheduledSeq(seq, 1) for seq in seqs]

"""ModelRunner: owns the model and the KV cache; flattens a step into tensors, runs it, samples.

Host->device copies happen only here.
"""

from __future__ import annotations

import logging

import torch

from batchgen.engine.attention import build_attention_metadata
from batchgen.engine.config import EngineConfig
from batchgen.engine.decode_staging import DecodeRows, StagingPool
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.llama import LlamaForCausalLM
from batchgen.engine.sampler import Sampler
from batchgen.engine.scheduler import ScheduledSeq
from batchgen.kernels import cpu_paged_attention

log = logging.getLogger("batchgen.engine")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: LlamaForCausalLM,
                 num_blocks: int, eos_token_ids: tuple[int, ...]):
        self.config = config
        self.model_cfg = model_cfg
        self.model = model
        self.device = config.torch_device
        self.block_size = config.block_size
        self.sampler = Sampler(eos_token_ids)
        num_slots = num_blocks * config.block_size
        # Per layer: K and V caches as (num_slots, kv_heads, head_dim); slot = block * block_size + offset.
        shape = (num_slots, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=config.torch_dtype, device=self.device),
             torch.zeros(shape, dtype=config.torch_dtype, device=self.device))
            for _ in range(model_cfg.num_layers)
        ]
        # On the CPU in float32 the torch backend attends in place in the paged cache with the C
        # kernels; otherwise decodes read dense staging rows (see decode_staging.py), capped at the
        # pool's own size so staging never more than doubles KV memory.
        self.is_paged = (config.attention_backend != "sdpa" and self.device.type == "cpu"
                         and config.torch_dtype == torch.float32 and model_cfg.head_dim % 16 == 0
                         and cpu_paged_attention.is_available())
        self.decode_rows: DecodeRows | None = None
        self.staging_pool: StagingPool | None = None
        if not self.is_paged:
            self.decode_rows = DecodeRows(config.block_size, model_cfg.num_kv_heads, max_tokens=num_slots)
            self.staging_pool = StagingPool(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                                            config.torch_dtype, self.device)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], num_live_seqs: int = 0) -> list[tuple[ScheduledSeq, int, float]]:
        """Run one step; returns (scheduled seq, token, raw logprob) for each sequence that samples.
        `num_live_seqs`: unfinished sequences that may decode soon (sizes the decode staging rows)."""
        # Decodes first (in staging-row order when staged), then prefill chunks: each group is
        # attended as one batch.
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        # Chunks that continue a cached context first, similar lengths side by side so their attention
        # groups pad little (see _split_by_padding); fresh prompts last (attended in place).
        prefills = sorted((s for s in scheduled if s.num_new_tokens != 1),
                          key=lambda s: (s.seq.num_computed_tokens == 0, s.num_new_tokens, s.seq.num_computed_tokens))
        staging = None
        if self.decode_rows is not None:
            if decodes and self.decode_rows.can_stage([s.seq for s in decodes], num_live_seqs):
                by_seq = {id(s.seq): s for s in decodes}
                row_seqs, staging = self.decode_rows.plan([s.seq for s in decodes], self.device, num_live_seqs)
                decodes = [by_seq[id(seq)] for seq in row_seqs]
                self.staging_pool.resize(*staging.capacity)
            elif self.decode_rows.capacity != (0, 0):
                self.decode_rows.reset()
                self.staging_pool.resize(0, 0)  # give the memory back; rows refill when staging resumes
        order = decodes + prefills
        num_decodes = len(decodes)
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        sampling: list[ScheduledSeq] = []
        for s in order:
            start = s.seq.num_computed_tokens
            input_ids.extend(s.seq.token_ids[start:start + s.num_new_tokens])
            positions.extend(range(start, start + s.num_new_tokens))
            if s.is_sampling:
                logits_rows.append(len(input_ids) - 1)
                sampling.append(s)
        meta = build_attention_metadata(
            [s.num_new_tokens for s in order], [s.seq.num_computed_tokens for s in order],
            [s.seq.block_ids for s in order], num_decodes, self.block_size, self.device, staging,
            is_paged=self.is_paged)
        layer_kvs = self.kv_caches
        if staging is not None:
            layer_kvs = [(k, v, buffers) for (k, v), buffers in zip(self.kv_caches, self.staging_pool.layers)]
        device = self.device
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            layer_kvs, meta, torch.tensor(logits_rows, dtype=torch.long, device=device),
        )  # (N, V)
        if not sampling:
            return []
        tokens, logprobs = self.sampler(logits, [s.seq for s in sampling])
        return list(zip(sampling, tokens, logprobs))

"""ModelRunner: owns the model and the KV cache; flattens a step into tensors, runs it, samples.

Host->device copies happen only here.
"""

from __future__ import annotations

import torch

from batchgen.engine.attention import allocate_kv_caches
from batchgen.engine.capabilities import Capabilities
from batchgen.engine.config import EngineConfig
from batchgen.engine.logprobs import top_logprobs
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.llama import LlamaForCausalLM
from batchgen.engine.sampler import Sampler
from batchgen.engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: LlamaForCausalLM,
                 num_blocks: int, eos_token_ids: tuple[int, ...], capabilities: Capabilities):
        self.config = config
        self.model_cfg = model_cfg
        self.model = model
        self.device = config.torch_device
        self.block_size = config.block_size
        self.sampler = Sampler(eos_token_ids, is_c_sampling=capabilities.is_c_sampling)
        num_slots = num_blocks * config.block_size
        # Per layer: K and V caches as (num_slots, kv_heads, head_dim); slot = block * block_size + offset.
        # In engine.kv_cache_dtype (FP8: with per-layer scales, from the checkpoint or calibrated).
        if config.kv_torch_dtype != config.torch_dtype and not model.backend.supports_fp8_kv:
            raise ValueError(f"engine.kv_cache_dtype {config.kv_cache_dtype} needs attention_backend cpu or triton; "
                             f"this model attends through {model.backend.name}")
        self.kv_caches = allocate_kv_caches(
            model_cfg.num_layers, num_slots, model_cfg.num_kv_heads, model_cfg.head_dim, config.kv_torch_dtype,
            self.device, checkpoint_scales=getattr(model, "kv_cache_scales", None),
            calculate_scales=config.calculate_kv_scales)
        # This engine's half of the model's attention backend (its per-step metadata, any state it
        # keeps across steps); the model's layers call the backend itself.
        self.attention = model.backend.make_metadata_builder(model_cfg.num_layers, num_slots, config.block_size,
                                                             config.torch_dtype, self.device)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], num_live_seqs: int = 0) -> list[
            tuple[ScheduledSeq, int, float, list[tuple[int, float]] | None]]:
        """Run one step; returns (scheduled seq, token, raw logprob, top logprobs or None) for each
        sequence that samples.
        `num_live_seqs`: unfinished sequences that may decode soon (the backend may plan for them)."""
        # Decodes first, in the order the attention backend asks for, then prefill chunks.
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        by_seq = {id(s.seq): s for s in decodes}
        decodes = [by_seq[id(seq)] for seq in self.attention.reorder_decodes([s.seq for s in decodes], num_live_seqs)]
        # Chunks that continue a cached context first, similar lengths side by side (attended in
        # padded groups where the backend gathers keys, so neighbours pad little); fresh prompts last.
        prefills = sorted((s for s in scheduled if s.num_new_tokens != 1),
                          key=lambda s: (s.seq.num_computed_tokens == 0, s.num_new_tokens, s.seq.num_computed_tokens))
        order = decodes + prefills
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
        meta = self.attention.build([s.num_new_tokens for s in order], [s.seq.num_computed_tokens for s in order],
                                    [s.seq.block_ids for s in order], len(decodes))
        device = self.device
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            self.kv_caches, meta, torch.tensor(logits_rows, dtype=torch.long, device=device),
        )  # (N, V)
        if not sampling:
            return []
        seqs = [s.seq for s in sampling]
        tops = top_logprobs(logits, seqs)  # before the sampler, which may edit the logits in place
        tokens, logprobs = self.sampler(logits, seqs)
        return list(zip(sampling, tokens, logprobs, tops))

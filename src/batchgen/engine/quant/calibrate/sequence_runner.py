"""Run a model on whole sequences with a private KV cache, bypassing the scheduler.

What benchmarks and quality checks need and the engine loop does not give: every completion
position's logits (teacher forcing), and a fixed-batch greedy/decode loop over a bare model (the
GPU check's random-weight models have no tokenizer). The cache uses the engine's own layout and
attention metadata, so the numbers are those of the modules the engine runs.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.attention import allocate_kv_caches


class SequenceRunner:
    """A fixed set of `num_seqs` sequence slots of up to `max_seq_len` tokens each."""

    def __init__(self, model: nn.Module, num_seqs: int, max_seq_len: int, block_size: int = 16,
                 kv_cache_dtype: torch.dtype | None = None, calculate_kv_scales: bool = False):
        """kv_cache_dtype: None for the weights' dtype, or an FP8 format (scales as the engine sets them:
        the checkpoint's, else 1.0, or calibrated on the first forward with calculate_kv_scales)."""
        cfg = model.cfg
        weight = model.embed_tokens.weight
        self.model = model
        self.block_size = block_size
        self.device = weight.device
        blocks_per_seq = -(-max_seq_len // block_size)
        num_slots = num_seqs * blocks_per_seq * block_size
        self.kv_caches = allocate_kv_caches(  # the ModelRunner's per-layer K/V layout
            cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype or weight.dtype, self.device,
            checkpoint_scales=getattr(model, "kv_cache_scales", None), calculate_scales=calculate_kv_scales)
        self.block_tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
        # The model's own attention backend, as in the engine (no reordering: no decode staging).
        self.attention = model.backend.make_metadata_builder(cfg.num_layers, num_slots, block_size,
                                                             weight.dtype, self.device)

    @torch.inference_mode()
    def forward(self, new_tokens: list[list[int]], context_lens: list[int],
                logits_rows: list[int] | None = None) -> torch.Tensor:
        """Append new_tokens[i] to slot i (which holds context_lens[i] tokens); logits (N, V) float32.

        logits_rows indexes the flat concatenation of new_tokens; default: each sequence's last token.
        All sequences are decodes (one token each) or all are prefills: one attention group either way.
        """
        lens = [len(t) for t in new_tokens]
        num_decodes = len(lens) if all(n == 1 for n in lens) else 0
        if logits_rows is None:
            ends = torch.tensor(lens).cumsum(0)
            logits_rows = (ends - 1).tolist()
        ids = [t for seq in new_tokens for t in seq]
        positions = [p for c, n in zip(context_lens, lens) for p in range(c, c + n)]
        meta = self.attention.build(lens, context_lens, self.block_tables[:len(lens)], num_decodes)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        return self.model(as_tensor(ids), as_tensor(positions), self.kv_caches, meta, as_tensor(logits_rows))


def teacher_forced_logits(model: nn.Module, prompts: list[list[int]], completions: list[list[int]],
                          **kv_options) -> list[torch.Tensor]:
    """For each (prompt, completion): logits (C, V) float32 predicting each completion token from
    the prompt and the completion tokens before it (one batched prefill). kv_options: SequenceRunner's
    kv_cache_dtype and calculate_kv_scales."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    runner = SequenceRunner(model, len(seqs), max(len(s) for s in seqs), **kv_options)
    rows: list[int] = []
    start = 0
    for p, c, s in zip(prompts, completions, seqs):
        rows.extend(range(start + len(p) - 1, start + len(p) + len(c) - 1))
        start += len(s)
    logits = runner.forward(seqs, [0] * len(seqs), rows)  # (sum C, V)
    return list(logits.split([len(c) for c in completions]))


def greedy_generate(model: nn.Module, prompts: list[list[int]], max_tokens: int,
                    eos_token_ids: tuple[int, ...] = (), **kv_options) -> list[list[int]]:
    """Greedy completions (argmax each step), cut after the first EOS token; all prompts as one batch."""
    runner = SequenceRunner(model, len(prompts), max(len(p) for p in prompts) + max_tokens, **kv_options)
    tokens = runner.forward(prompts, [0] * len(prompts)).argmax(-1).tolist()
    outputs = [[t] for t in tokens]
    context = [len(p) for p in prompts]
    for _ in range(max_tokens - 1):
        tokens = runner.forward([[t] for t in tokens], context).argmax(-1).tolist()
        context = [c + 1 for c in context]
        for out, t in zip(outputs, tokens):
            out.append(t)
    eos = set(eos_token_ids)
    return [out[:next((i + 1 for i, t in enumerate(out) if t in eos), len(out))] for out in outputs]

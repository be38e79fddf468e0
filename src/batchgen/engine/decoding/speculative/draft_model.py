"""Draft-model proposals: a smaller model with the same vocabulary drafts k tokens autoregressively.

The draft runs through the engine's own pieces (an LLMEngine of its own, made by the class the target
hands over: loader, KV cache manager, model runner, sampler) on its own KV pool. Each target sequence
has a mirror sequence in the draft engine that holds the draft's KV for the target's tokens plus its
own last proposals; after a verify
step the mirror keeps the KV of the common prefix (num_computed_tokens rolled back) and catches up
with the target's new tokens in its next round's first chunk. The mirror samples with the target
sequence's key, so at each position the draft's token comes from the same keyed draw as the
target's (coupled sampling): where the two processed distributions are close, they pick the same.
"""

from __future__ import annotations

import logging

from batchgen.engine.config import EngineConfig, SettingError, SpeculativeConfig
from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.core.sequence import Sequence

log = logging.getLogger("batchgen.engine")


class DraftModelProposer:
    def __init__(self, target, spec: SpeculativeConfig, engine_class: type):
        """`target`: the LLMEngine whose sequences are drafted for; `engine_class`: LLMEngine, which the
        draft is (handed over: the engine imports this module, not the other way)."""
        config: EngineConfig = target.config
        # The draft's quantization: as asked (fp8: the FP8 weight path, e.g. the target itself perturbed);
        # else the target's for the target's own model (its weights are then shared), auto for another.
        quantization = spec.quantization or (config.quantization if spec.model == config.model else "auto")
        draft_config = config.replace(
            model=spec.model, quantization=quantization, quantize_lm_head=False,
            revision=config.revision if spec.model == config.model else None,  # the target's revision is its own
            speculative=None, enable_prefix_caching=False, max_model_len=target.max_model_len,
            # As many tokens as the target's pool: a running target sequence always fits.
            num_kv_blocks=target.num_kv_blocks,
            # Speculation runs on rank 0's view: a tensor-parallel target's draft is whole, in rank 0's process.
            tensor_parallel_size=1,
            # the target's merged adapter is its own model's: a draft of another model loads without it
            merged_lora=config.merged_lora if spec.model == config.model else None)
        # A tensor-parallel target's weights are shards: the draft loads its own copy.
        is_same_model = (draft_config.model == config.model and draft_config.quantization == config.quantization
                         and not config.quantize_lm_head and config.tensor_parallel_size == 1)
        self.engine = engine_class(draft_config, weights_from=target if is_same_model else None)
        # A mirror steps back over its rejected proposals (_synced_mirror): its local blocks (a model with
        # sliding windows) are kept that far behind the window.
        self.engine.kv_cache_manager.lookback_tokens = spec.num_speculative_tokens + 1
        check_same_vocabulary(target, self.engine)
        self.mirrors: dict[int, Sequence] = {}  # id(target sequence) -> its mirror
        # id(mirror) -> its target's token count at the last sync: what follows are the mirror's proposals.
        self.base_lens: dict[int, int] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """Per sequence, up to num_tokens[i] draft tokens: k forward passes of the draft for the batch."""
        kv = self.engine.kv_cache_manager
        mirrors: list[Sequence | None] = []
        for seq in seqs:
            mirror = self._synced_mirror(seq)
            mirrors.append(mirror)
        wanted = dict(zip(map(id, mirrors), num_tokens))
        active = [m for m, k in zip(mirrors, num_tokens) if k > 0]
        while active:
            scheduled = []
            for mirror in active:
                num_new = mirror.num_tokens - mirror.num_computed_tokens
                if kv.allocate_slots(mirror, num_new):
                    scheduled.append(ScheduledSeq(mirror, num_new))
            if not scheduled:
                break
            for row in self.engine.runner.execute(scheduled):  # one row each: no drafts here
                row.scheduled.seq.num_computed_tokens += row.scheduled.num_new_tokens
                row.scheduled.seq.token_ids.append(row.token_id)
            active = [s.seq for s in scheduled
                      if s.seq.num_tokens - self.base_lens[id(s.seq)] < wanted[id(s.seq)]]
        return [m.token_ids[self.base_lens[id(m)]:] for m in mirrors]

    def _synced_mirror(self, seq: Sequence) -> Sequence:
        """The mirror of `seq` with the target's tokens and the KV of their common prefix kept."""
        mirror = self.mirrors.get(id(seq))
        if mirror is None:
            mirror = Sequence(seq.request_id, seq.sample_index, seq.prompt_token_ids, seq.params,
                              seq.times.arrival_time, seq.max_total_tokens, seq.sample_key)
            mirror.random_key = seq.random_key
            self.mirrors[id(seq)] = mirror
        else:
            # The mirror's tokens are the target's of the last round plus its proposals; the common
            # prefix is at least the last round's tokens, so compare only what follows them.
            common = self.base_lens[id(mirror)]
            end = min(mirror.num_tokens, seq.num_tokens)
            while common < end and mirror.token_ids[common] == seq.token_ids[common]:
                common += 1
            # The last target token is always fed again (its KV rewritten with the same values): its
            # logits give the first draft. A mirror can have computed it already, when the target took
            # fewer drafts than proposed (no room in its pool or step) and they matched.
            mirror.num_computed_tokens = min(mirror.num_computed_tokens, common, seq.num_tokens - 1)
            if common < mirror.num_tokens:
                del mirror.token_ids[common:]
                # Its penalty counts (on the device) hold the rejected proposals: rebuilt from its
                # tokens when it next samples.
                self.engine.runner.release(mirror)
        mirror.token_ids.extend(seq.token_ids[mirror.num_tokens:])
        self.base_lens[id(mirror)] = seq.num_tokens
        return mirror

    def retain(self, running: list[Sequence]) -> None:
        """Free the mirrors of sequences no longer running (preempted: they recompute from scratch)."""
        keep = {id(seq) for seq in running}
        for key in [k for k in self.mirrors if k not in keep]:
            self._free(self.mirrors.pop(key))

    def release(self, seq: Sequence) -> None:
        """The target sequence finished, was aborted or preempted: its mirror's blocks go back."""
        mirror = self.mirrors.pop(id(seq), None)
        if mirror is not None:
            self._free(mirror)

    def _free(self, mirror: Sequence) -> None:
        self.base_lens.pop(id(mirror), None)
        self.engine.kv_cache_manager.free(mirror)
        self.engine.runner.release(mirror)


def check_same_vocabulary(target, draft) -> None:
    """The draft proposes token ids the target reads: same vocabulary size and the same tokens."""
    if draft.model_cfg.vocab_size != target.model_cfg.vocab_size:
        raise SettingError("SpeculativeConfig", "model", f"must share the target's vocabulary "
                           f"({target.model_cfg.vocab_size} tokens; the draft has {draft.model_cfg.vocab_size})",
                           draft.config.model)
    if draft.tokenizer is not target.tokenizer and draft.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
        raise SettingError("SpeculativeConfig", "model", "must use the target's tokenizer (the token "
                           "strings of the two vocabularies differ)", draft.config.model)

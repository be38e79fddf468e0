"""Speculative decoding (`engine.speculative`): proposals drafted before a step, verified in it.

A proposer (n-gram lookup or a draft model) drafts up to k tokens for each running sequence that is
about to decode; the scheduler gives such a sequence a (1 + k)-token chunk over its cached context,
which the model runner runs like any prefill chunk and samples at all 1 + k positions, each with the
processed distribution plain decoding would use there and that position's keyed draw. The scheduler
(update_from_output) keeps the drafts that equal the sampled tokens, then the first sampled token that
differs (or the bonus token after k accepted drafts): exactly the tokens plain decoding emits, one per
position.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.config import SpeculativeConfig
from batchgen.engine.core.sequence import Sequence


@dataclass
class SpecStats:
    num_spec_steps: int = 0  # engine steps that verified drafts
    num_verifies: int = 0  # (sequence, step) pairs that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def count(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verify in a step."""
        self.num_verifies += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    def as_dict(self) -> dict:
        return {
            "num_spec_steps": self.num_spec_steps, "num_verifies": self.num_verifies,
            "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            # vLLM's mean acceptance length: tokens emitted per verify, the target's own one included.
            "mean_accepted_length": 1 + self.num_accepted_tokens / self.num_verifies if self.num_verifies else 0.0,
        }


class SpecDecoder:
    """The engine's speculative half: which sequences draft this step, the proposer, the counters."""

    def __init__(self, spec: SpeculativeConfig, engine, engine_class: type):
        """`engine`: the LLMEngine speculating; `engine_class`: LLMEngine, for a draft model's own engine."""
        self.spec = spec
        if spec.method == "ngram":
            from batchgen.engine.decoding.speculative.ngram import NgramProposer

            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            from batchgen.engine.decoding.speculative.draft_model import DraftModelProposer

            self.proposer = DraftModelProposer(engine, spec, engine_class)
        self.stats = SpecStats()

    def propose(self, running: list[Sequence]) -> None:
        """Set `draft_token_ids` of the running sequences that decode next, if this step speculates."""
        for seq in running:
            seq.draft_token_ids = []
        self.proposer.retain(running)
        if len(running) > self.spec.max_batch_size:
            return
        seqs, budgets = [], []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not seq.can_speculate:
                continue  # still prefilling (or recomputing), a beam or a prompt-only part: no draft
            # No draft past what can be emitted: the last token plain decoding would sample.
            k = min(self.spec.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                    seq.max_total_tokens - seq.num_tokens - 1)
            if k > 0:
                seqs.append(seq)
                budgets.append(k)
        if not seqs:
            return
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, budgets)):
            if seq.grammar is not None and drafts:  # a constrained sequence verifies only what its grammar allows
                drafts = drafts[:seq.grammar.validate_tokens(drafts)]
            seq.draft_token_ids = drafts

    def release(self, seq: Sequence) -> None:
        seq.draft_token_ids = []
        self.proposer.release(seq)

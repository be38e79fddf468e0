"""Writes engine/quant/calibrate/calibration_text.txt: the text `int_calibration: activation_aware` calibrates on.

Data-free, as LLM-QAT's self-generated calibration data: the bundled SmolLM2-135M-Instruct samples
`num_docs` documents of `num_tokens` tokens each at temperature 1 (seed 0), each started from the
chat template's user header, so the text is chat, prose and code in the model family's own mix and
no dataset is downloaded or shipped. Samples at temperature 1 wander; documents touching violent or
sexual words (UNWANTED) are dropped, and the first `num_kept` others are written, separated by a
blank line and a form feed (the engine reads its first NUM_CALIBRATION_TOKENS tokens).

CLI: python -m batchgen.bench.calibration_text [--num-docs 64] [--num-kept 16] [--num-tokens 512] [--output PATH]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from batchgen.engine.quant.calibrate.activation_aware import CALIBRATION_TEXT, DOCUMENT_SEPARATOR

START = "<|im_start|>user\n"
UNWANTED = re.compile(r"sex|rape|nazi|kill|murder|suicide|porn|bitch|fuck|shit|drug|weapon|terror", re.IGNORECASE)


@torch.inference_mode()
def sample_documents(model, tokenizer, num_docs: int, num_tokens: int, seed: int = 0) -> list[str]:
    """`num_docs` texts of `num_tokens` tokens sampled from `model` at temperature 1, all in one batch."""
    from batchgen.engine.quant.calibrate.sequence_runner import SequenceRunner

    start = tokenizer.encode(START)
    generator = torch.Generator().manual_seed(seed)
    runner = SequenceRunner(model, num_docs, len(start) + num_tokens)
    docs = [list(start) for _ in range(num_docs)]
    logits = runner.forward(docs, [0] * num_docs)  # (num_docs, V)
    for _ in range(num_tokens):
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1).tolist()
        context = [len(d) for d in docs]
        for doc, token in zip(docs, tokens):
            doc.append(token)
        logits = runner.forward([[t] for t in tokens], context)
    return [tokenizer.decode(d[len(start):]) for d in docs]


def main(argv: list[str] | None = None) -> None:
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.loader.model_loader import load_model
    from batchgen.engine.text.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description="sample the bundled calibration text")
    parser.add_argument("--num-docs", type=int, default=64)
    parser.add_argument("--num-kept", type=int, default=16)
    parser.add_argument("--num-tokens", type=int, default=512)
    parser.add_argument("--output", type=Path, default=CALIBRATION_TEXT)
    args = parser.parse_args(argv)
    loaded = load_model(EngineConfig(model="smollm2-135m-instruct", dtype="float32", device="cpu",
                                     max_model_len=2048))
    docs = sample_documents(loaded.model, Tokenizer(loaded.source), args.num_docs, args.num_tokens)
    kept = [d for d in docs if not UNWANTED.search(d)][:args.num_kept]
    args.output.write_text(DOCUMENT_SEPARATOR.join(kept), encoding="utf-8")
    print(f"sampled {len(docs)} documents, wrote {len(kept)} ({sum(map(len, kept))} characters) to {args.output}")


if __name__ == "__main__":
    main()

"""A small byte-level BPE tokenizer for GGUF files the tests write, in place of the bundled GGUF's 49k-token one.

transformers converts a GGUF's tokenizer when the engine loads the file (AutoTokenizer with gguf_file): for
the bundled vocabulary that takes ~11 s, and reading its keys to copy them ~6 s more, per file. The GGUF twin
tests compare token ids and logits, never text, so a file carries these 263 tokens (three specials, the 256
byte symbols of GPT-2's byte-level alphabet, three merges) and states the model's vocabulary size in
`{arch}.vocab_size`, which the loader reads first. Token ids past the tokenizer's own decode to nothing.
"""

from __future__ import annotations

UNK, BOS, EOS = 0, 1, 2


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the symbol of each byte value, printable ones as themselves."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in printable}
    shift = 256
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(shift)
            shift += 1
    return [symbols[b] for b in range(256)]


def add_small_tokenizer(writer, vocab_size: int) -> None:
    """Write the small tokenizer's keys (tokenizer.ggml.*, model gpt2) and the model's vocab_size to `writer`
    (a gguf.GGUFWriter)."""
    tokens = ["<unk>", "<s>", "</s>", *byte_symbols(), "Ġt", "he", "Ġthe"]
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3: control, 1: normal
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_unk_token_id(UNK)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)

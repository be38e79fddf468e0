"""Finding and reading model checkpoints (HF folders, GGUF files), local or through fsspec."""

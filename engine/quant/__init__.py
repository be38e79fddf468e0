"""Weight quantization (FP8)."""

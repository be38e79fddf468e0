"""Weight quantization: FP8 and integer (int8 / int4, GPTQ, AWQ, compressed-tensors, GGUF blocks) linear layers."""

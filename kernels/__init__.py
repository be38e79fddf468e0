"""batchgen.kernels: Triton kernels with their pure-torch references, and the CPU decode-attention
kernel that reads the paged KV cache in place (C, built on first use; see cpu_decode_attention.py).
Imports only torch/triton."""

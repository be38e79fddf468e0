"""batchgen.kernels: Triton kernels with their pure-torch references, and the CPU decode-attention
kernels that read the paged KV cache in place, fused elementwise ops and the greedy pick
(C, built on first use; see c_library.py).
Imports only torch/triton."""

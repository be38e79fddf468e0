"""batchgen.kernels: Triton kernels with their pure-torch references, and C kernels for the CPU
(paged attention in place in the KV cache, fused elementwise ops, the greedy pick), built on first
use (see c_library.py). Imports only torch/triton."""

"""batchgen.kernels: Triton kernels and their pure-torch references (imports only torch/triton)."""

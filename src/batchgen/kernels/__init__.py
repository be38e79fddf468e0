"""batchgen.kernels: the engine's hand-written kernels and their torch references.

- C kernels for the CPU in float32 and bfloat16, sources in csrc/ (package data), built with the
  system compiler on first use for the CPU's instruction set (cpu_isa.py; `BATCHGEN_CPU_ISA` forces
  a lower one) and loaded with ctypes by c_library.py: paged decode and prefill attention read in
  place from the KV cache (cpu_paged_attention), the cache write (cpu_kv_store), the fused
  elementwise ops (cpu_elementwise) and the greedy pick with log Z and the sampler's top-k
  candidates (cpu_sampling). Each module's
  `is_available()` says whether its library loaded; without it the engine keeps its torch path.
  The attention kernels read float32, bfloat16 (widened by a shift) and FP8 caches (one byte per
  value through a 256-entry table).
- Triton: paged attention for a whole engine step (triton_paged_attention) and the KV store
  (triton_kv_store), the CUDA attention path; the weight-only FP8 matmul (fp8_matmul); the integer
  weight-only matmul (triton_int_matmul), the two sharing their tile walk, loads and store
  (matmul_tiles); every kernel's tiles and warps per shape key (triton_tuning: a fixed first
  candidate, or timed with BATCHGEN_TRITON_AUTOTUNE=1).
- kv_formats.py: the FP8 KV cache format (e4m3fn / e5m2, clamp, per-layer scale) they all share.
- reference.py: every kernel's pure-torch reference, which tests/kernels/ holds the kernels to.
- cache_dir.py: the per-user cache root (`BATCHGEN_CACHE_DIR`) shared with the engine's model cache.

Imports only torch and triton; never the engine.
"""

from batchgen.kernels import cpu_isa as _cpu_isa

# A forced BATCHGEN_CPU_ISA caps oneDNN and MKL too; they read their variables at their first GEMM, which
# comes after this import in every engine path. A value the CPU cannot run is reported where the kernels
# load.
try:
    _cpu_isa.cap_libraries(_cpu_isa.selected_isa())
except ValueError:
    pass

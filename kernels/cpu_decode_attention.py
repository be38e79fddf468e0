"""Decode attention for the CPU: one pass over each row's staged K and V, a small C kernel.

SDPA's CPU flash kernel is built for long query blocks; a decode step has 1 query per sequence (a
GQA group of `group` query heads per KV head), and there it reads K/V at about half the rate of a
plain streaming read (SmolLM2, 64 rows x ~264 keys, cold: 1.94 ms per layer vs 0.7-0.9 ms just to
read the same bytes). This kernel reads each K row once for all the group's queries, runs an exact
two-pass softmax in float32 over the row's own length (no padding, no mask), then reads each V row
once. Work is split over (row, KV head) pairs by OpenMP, in torch's own thread pool.

It is C compiled on first use with the system compiler (`cc`, -O3 -march=native) into a per-user
cache keyed by source and CPU flags, and loaded with ctypes: no torch headers, so it builds in
about a second. Without a compiler (or on anything but Linux x86/arm) `is_available()` is False
and the engine keeps SDPA.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("batchgen.kernels")

_SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdlib.h>

typedef struct {
    const float *q, *k, *v;
    const int *lengths;
    float *out;
    int num_kv_heads, group, head_dim, max_len;
    long row_stride, head_stride;
    float scale;
} job_t;

/* One (row, kv head) pair: q, out (group, D); keys and values (len, D) rows. */
static void attend_pair(const job_t *j, int pair, float *scores) {
    const int b = pair / j->num_kv_heads, h = pair % j->num_kv_heads;
    const int G = j->group, D = j->head_dim, L = j->lengths[b];
    const float *q = j->q + (long)pair * G * D;
    const float *k = j->k + b * j->row_stride + h * j->head_stride;
    const float *v = j->v + b * j->row_stride + h * j->head_stride;
    float *out = j->out + (long)pair * G * D;
    for (int l = 0; l < L; l++) {
        const float *kr = k + (long)l * D;
        for (int g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float s = 0.f;
            for (int d = 0; d < D; d++) s += qg[d] * kr[d];
            scores[g * L + l] = s * j->scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = scores + g * L, m = -FLT_MAX, sum = 0.f;
        for (int l = 0; l < L; l++) m = sg[l] > m ? sg[l] : m;
        for (int l = 0; l < L; l++) { sg[l] = expf(sg[l] - m); sum += sg[l]; }
        const float inv = 1.f / sum;
        for (int l = 0; l < L; l++) sg[l] *= inv;
        for (int d = 0; d < D; d++) out[g * D + d] = 0.f;
    }
    for (int l = 0; l < L; l++) {
        const float *vr = v + (long)l * D;
        for (int g = 0; g < G; g++) {
            const float p = scores[g * L + l];
            float *og = out + g * D;
            for (int d = 0; d < D; d++) og[d] += p * vr[d];
        }
    }
}

/* Returns 0 on success. q, out: (rows, Hkv, group, D) contiguous; k, v: (rows, Hkv, C, D) with
   the given row and head strides (elements) and contiguous (C, D) tokens. */
int decode_attention(const float *q, const float *k, const float *v, const int *lengths, float *out,
                     int num_rows, int num_kv_heads, int group, int head_dim,
                     long row_stride, long head_stride, float scale, int num_threads) {
    int max_len = 1;
    for (int b = 0; b < num_rows; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;
    const int num_pairs = num_rows * num_kv_heads;
    const job_t j = {q, k, v, lengths, out, num_kv_heads, group, head_dim, max_len,
                     row_stride, head_stride, scale};
    int failed = 0;
    /* OpenMP from torch's own libgomp (same soname, already loaded): torch's worker threads, which
       are still spinning after the previous op, take the pairs; no second thread pool competes. */
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)group * (size_t)max_len);
        if (!scores) failed = 1;
        #pragma omp for schedule(static)
        for (int pair = 0; pair < num_pairs; pair++)
            if (scores) attend_pair(&j, pair, scores);
        free(scores);
    }
    return failed;
}
"""

# -ffast-math only when compiling (vectorized reductions and expf); linking without it keeps GCC's
# crtfastmath out of the library, whose constructor would switch the loading thread to flush-to-zero.
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-fopenmp"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_library: ctypes.CDLL | None = None
_is_tried = False


def _cpu_fingerprint() -> str:
    """-march=native code is only valid on the CPU that built it: key the cache by its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("BATCHGEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchgen")
    return Path(root) / "kernels"


def _build(path: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        source = Path(tmp) / "decode_attention.c"
        source.write_text(_SOURCE)
        obj, built = Path(tmp) / "decode_attention.o", Path(tmp) / path.name
        subprocess.run([compiler, *_COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                       check=True, capture_output=True, timeout=120)
        subprocess.run([compiler, *_LINK_FLAGS, str(obj), "-o", str(built), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(built, path)  # atomic: concurrent builders never load a half-written file


def _load() -> ctypes.CDLL | None:
    global _library, _is_tried
    if _is_tried:
        return _library
    _is_tried = True
    if not sys.platform.startswith("linux"):
        return None
    flags = " ".join(_COMPILE_FLAGS + _LINK_FLAGS)
    key = hashlib.sha256((_SOURCE + flags + _cpu_fingerprint()).encode()).hexdigest()[:16]
    path = _cache_dir() / f"decode_attention-{key}.so"
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("CPU decode-attention kernel unavailable (%s %s); using SDPA", exc, detail.decode()[:200])
        return None
    fn = lib.decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_long] * 2 + [ctypes.c_float, ctypes.c_int]
    _library = lib
    return lib


def is_available() -> bool:
    """True once the kernel is built (or found in the cache) and loaded."""
    return _load() is not None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: (B, Hkv, G, D) float32; k, v: (>= B, Hkv, C, D) float32 with contiguous (C, D) per head;
    lengths: (B,) int32, keys [0, lengths[b]) of row b. Returns (B, Hkv, G, D)."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU decode-attention kernel is not available (see is_available())")
    num_rows, num_kv_heads, group, head_dim = q.shape
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise TypeError("decode_attention takes float32 tensors")
    if k.stride() != v.stride() or k.stride(3) != 1 or k.stride(2) != head_dim:
        raise ValueError(f"k and v need contiguous (C, D) rows and equal strides, got {k.stride()} and {v.stride()}")
    if int(lengths.max()) > k.shape[2]:
        raise ValueError("a row is longer than the staged K/V capacity")
    q = q.contiguous()
    lengths = lengths.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    rc = lib.decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), lengths.data_ptr(), out.data_ptr(),
                              num_rows, num_kv_heads, group, head_dim, k.stride(0), k.stride(1),
                              scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU decode-attention kernel: out of memory for its score rows")
    return out

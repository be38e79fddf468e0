"""ISA dispatch of the C kernels: the level found from the CPU's flags, BATCHGEN_CPU_ISA forcing a lower
one, and the AVX2 build on this machine computing what the native build computes (in a subprocess:
a process loads each library once)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchgen.kernels import cpu_isa, cpu_paged_attention
from batchgen.kernels.c_library import compile_flags
from tests.kernels.helpers import scattered_paged_cache

AVX2 = frozenset({"avx2", "fma", "sse4_2"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile"}


def test_the_level_is_the_highest_whose_flags_are_all_there(monkeypatch):
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    assert [cpu_isa.detect_isa(f) for f in (AVX2, AVX512, AVX512_BF16, AMX)] == list(cpu_isa.ISA_LEVELS)
    assert cpu_isa.detect_isa(AVX2 | {"avx512f"}) == "avx2"  # AVX-512 F alone is not the avx512 level
    assert cpu_isa.detect_isa(AVX2 | {"avx512_bf16"}) == "avx2"  # levels build on each other
    assert cpu_isa.detect_isa(frozenset({"sse4_2"})) == "native"
    assert [cpu_isa.has_bf16_units(level) for level in cpu_isa.ISA_LEVELS] == [False, False, True, True]


def test_a_forced_level_is_used_when_the_cpu_has_it_and_refused_when_not(monkeypatch):
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(cpu_isa.ISA_VARIABLE, raising=False)
    assert cpu_isa.selected_isa(AVX512_BF16) == "avx512_bf16"
    assert cpu_isa.march_flags("avx512_bf16") == ("-march=native",)
    monkeypatch.setenv(cpu_isa.ISA_VARIABLE, "AVX2")
    assert cpu_isa.selected_isa(AVX512_BF16) == "avx2"
    assert cpu_isa.march_flags("avx2") == ("-march=x86-64-v3", "-mtune=native")
    assert "-march=x86-64-v3" in compile_flags("avx2")
    monkeypatch.setenv(cpu_isa.ISA_VARIABLE, "avx512")  # the reverse: more than an AVX2 CPU has
    with pytest.raises(ValueError, match="BATCHGEN_CPU_ISA=avx512: this CPU supports at most avx2"):
        cpu_isa.selected_isa(AVX2)
    monkeypatch.setenv(cpu_isa.ISA_VARIABLE, "sse9")
    with pytest.raises(ValueError, match="must be one of native, avx2, avx512, avx512_bf16, amx"):
        cpu_isa.selected_isa(AVX2)
    monkeypatch.setenv(cpu_isa.ISA_VARIABLE, "native")
    assert cpu_isa.selected_isa(AVX2) == "avx2" and not cpu_isa.is_forced()


# The same kernels on the same inputs, run here (native build) and in a child forced to AVX2.
_KERNEL_RUN = r"""
import json, sys, torch
from batchgen.kernels import cpu_elementwise, cpu_kv_store, cpu_paged_attention, cpu_isa
from batchgen.kernels.c_library import kernel_cache_dir
from tests.kernels.helpers import scattered_paged_cache

def run():
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 17, 40, 33, 64]
    k32, v32, tables, _, _ = scattered_paged_cache(lengths, 3, 64, 16, seed=1)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), 3, 3, 64, generator=gen)
    out = {"decode_f32": cpu_paged_attention.paged_decode_attention(q, k32, v32, tables, lens, 16, 0.125)}
    k16, v16 = k32.to(torch.bfloat16), v32.to(torch.bfloat16)
    out["decode_bf16"] = cpu_paged_attention.paged_decode_attention(q.to(torch.bfloat16), k16, v16, tables, lens,
                                                                    16, 0.125)
    qp = torch.randn(sum(lengths), 9, 64, generator=gen)
    starts = torch.tensor([0, 1, 18, 58, 91], dtype=torch.int32)
    prefill = torch.empty_like(qp)
    cpu_paged_attention.paged_prefill_attention(qp, k16, v16, starts, lens, torch.zeros_like(lens), tables, 16,
                                                0.125, prefill)
    out["prefill_f32_over_bf16"] = prefill
    k2, v2, tables2, _, _ = scattered_paged_cache([37, 50], 2, 32, 4, seed=2)  # 32-dim heads: the narrow tiles
    q2 = torch.randn(87, 8, 32, generator=gen)
    narrow = torch.empty_like(q2)
    cpu_paged_attention.paged_prefill_attention(q2, k2, v2, torch.tensor([0, 37], dtype=torch.int32),
                                                torch.tensor([37, 50], dtype=torch.int32),
                                                torch.zeros(2, dtype=torch.int32), tables2, 4, 0.2, narrow)
    out["prefill_f32_32dim"] = narrow
    x, residual = torch.randn(70, 576, generator=gen), torch.randn(70, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    out["add_rms_norm_f32"] = cpu_elementwise.add_rms_norm(x, residual, weight, 1e-5)[0]
    out["add_rms_norm_bf16"] = cpu_elementwise.add_rms_norm(x.bfloat16(), residual.bfloat16(), weight.bfloat16(),
                                                            1e-5)[0]
    out["silu_mul_f32"] = cpu_elementwise.silu_mul(torch.randn(70, 3072, generator=gen))
    cache = torch.zeros(200, 3, 64, dtype=torch.bfloat16)
    cpu_kv_store.store_kv(x[:, :192].view(70, 3, 64), residual[:, :192].view(70, 3, 64), cache, cache.clone(),
                          torch.arange(70) * 2)
    out["store_bf16"] = cache.view(torch.int16)
    return out

if __name__ == "__main__":
    results = run()
    torch.save(results, sys.argv[1])
    print(json.dumps({"isa": cpu_isa.selected_isa(),
                      "library": str(cpu_paged_attention._LIBRARY.cache_path(kernel_cache_dir()))}))
"""


@pytest.mark.subprocess
@pytest.mark.skipif(cpu_isa.detect_isa() not in cpu_isa.ISA_LEVELS[1:],
                    reason="forcing AVX2 is a change only on a CPU above AVX2 (asking for more is refused above)")
def test_the_forced_avx2_build_computes_what_the_native_build_does(tmp_path):
    script = tmp_path / "kernel_run.py"
    script.write_text(_KERNEL_RUN)
    repo_root = Path(__file__).resolve().parents[2]  # the child imports tests.kernels.helpers
    env = {**os.environ, cpu_isa.ISA_VARIABLE: "avx2", "PYTHONPATH": str(repo_root)}
    child = subprocess.run([sys.executable, str(script), str(tmp_path / "avx2.pt")], env=env, capture_output=True,
                           text=True, timeout=300, check=True)
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["isa"] == "avx2"
    sys.path.insert(0, str(tmp_path))
    try:
        import kernel_run
    finally:
        sys.path.remove(str(tmp_path))
    native, avx2 = kernel_run.run(), torch.load(tmp_path / "avx2.pt")
    native_rounds_p = cpu_paged_attention.decode_rounds_probabilities(64, 16)
    _, values, _, _, _ = scattered_paged_cache([1, 17, 40, 33, 64], 3, 64, 16, seed=1)  # run()'s cache
    max_v = values.nan_to_num(0.0).abs().max().item()
    assert native.keys() == avx2.keys()
    for name, expected in native.items():
        if name == "store_bf16":  # a rounding, no arithmetic: bit for bit
            assert torch.equal(avx2[name], expected), name
        elif name == "decode_bf16" and native_rounds_p:  # bf16 probabilities on BF16 units: 2^-9 max|v| each
            torch.testing.assert_close(avx2[name].float(), expected.float(), rtol=2 ** -7, atol=2 ** -8 * max_v,
                                       msg=name)
        elif expected.dtype == torch.bfloat16:  # summation order may move a rounding by one step
            torch.testing.assert_close(avx2[name].float(), expected.float(), rtol=2 ** -7, atol=1e-5, msg=name)
        else:
            torch.testing.assert_close(avx2[name], expected, rtol=1e-5, atol=1e-5, msg=name)
    objdump = shutil.which("objdump")
    if objdump:  # the AVX2 build holds no AVX-512 register
        listing = subprocess.run([objdump, "-d", report["library"]], capture_output=True, text=True, check=True)
        assert "ymm" in listing.stdout and "zmm" not in listing.stdout

"""CPU tests of the dense GEMMs: validation paths, the reference against a naive loop, the CPU
backend, dispatch facts, and tracing through torch.compile."""

import pytest
import torch

from fi_core.errors import InputError, InputTypeError, UnsupportedError
from fi_gemm import bmm_bf16, bmm_fp8, mm_bf16
from fi_gemm.dense import api
from fi_gemm.dense.reference import gemm_reference

bf16, f16, e4m3, e5m2 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2


def _naive(a, w, bias=None, sa=1.0, sb=1.0):
    m, k = a.shape
    n = w.shape[0]
    out = torch.zeros(m, n, dtype=torch.float64)
    for i in range(m):
        for j in range(n):
            s = 0.0
            for kk in range(k):
                s += float(a[i, kk]) * float(w[j, kk])
            out[i, j] = s * sa * sb + (float(bias[j]) if bias is not None else 0.0)
    return out


def test_reference_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, generator=g).to(bf16)
    w = torch.randn(4, 5, generator=g).to(bf16)
    bias = torch.randn(4, generator=g).to(bf16)
    got = gemm_reference(a, w, torch.float32, bias)
    torch.testing.assert_close(got.double(), _naive(a, w, bias), atol=1e-5, rtol=1e-5)


def test_reference_fp8_scales_match_naive_loop():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 16, generator=g).to(e4m3)
    w = torch.randn(3, 16, generator=g).to(e5m2)
    sa, sb = torch.tensor([0.5]), torch.tensor([3.0])
    got = gemm_reference(a, w, torch.float32, None, sa, sb)
    torch.testing.assert_close(got.double(), _naive(a, w, None, 0.5, 3.0), atol=1e-5, rtol=1e-5)


def test_mm_bf16_cpu_matches_reference_with_bias_and_fp16_out():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(7, 24, generator=g).to(bf16)
    w = torch.randn(10, 24, generator=g).to(bf16)
    bias = torch.randn(10, generator=g).to(bf16)
    out = mm_bf16(a, w.T, bias, out_dtype=f16)
    assert out.dtype == f16 and out.shape == (7, 10)
    torch.testing.assert_close(out, gemm_reference(a, w, f16, bias), atol=0, rtol=0)


def test_mm_bf16_row_major_b_gives_same_result():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 16, generator=g).to(bf16)
    w = torch.randn(8, 16, generator=g).to(bf16)
    torch.testing.assert_close(mm_bf16(a, w.T.contiguous()), mm_bf16(a, w.T), atol=0, rtol=0)


def test_mm_bf16_writes_into_out():
    a = torch.randn(2, 8).to(bf16)
    w = torch.randn(3, 8).to(bf16)
    out = torch.full((2, 3), float("nan"), dtype=bf16)
    res = mm_bf16(a, w.T, out=out)
    assert res is out and torch.isfinite(out.float()).all()


def test_bmm_bf16_and_fp8_cpu():
    g = torch.Generator().manual_seed(4)
    A = torch.randn(2, 3, 32, generator=g).to(bf16)
    W = torch.randn(2, 5, 32, generator=g).to(bf16)
    torch.testing.assert_close(bmm_bf16(A, W.transpose(-2, -1)), gemm_reference(A, W, bf16))
    A8, W8 = A.to(e4m3), W.to(e4m3)
    sa, sb = torch.tensor([0.25]), torch.tensor([2.0])
    got = bmm_fp8(A8, W8.transpose(-2, -1), sa, sb, f16)
    torch.testing.assert_close(got, gemm_reference(A8, W8, f16, None, sa, sb), atol=0, rtol=0)


@pytest.mark.parametrize("call, exc, text", [
    (lambda: mm_bf16(torch.randn(2, 8), torch.randn(8, 3)), InputTypeError, "a must be bfloat16 or float16"),
    (lambda: mm_bf16(torch.randn(2, 8).to(bf16), torch.randn(8, 3).to(f16)), InputTypeError, "b must have a's dtype"),
    (lambda: mm_bf16(torch.randn(2, 8).to(bf16), torch.randn(7, 3).to(bf16)), InputError, "b must have shape [8, *]"),
    (lambda: mm_bf16(torch.randn(2, 8).to(bf16), torch.randn(8, 3).to(bf16), out_dtype=torch.float32), InputTypeError, "out_dtype"),
    (lambda: mm_bf16(torch.randn(2, 8).to(bf16), torch.randn(8, 3).to(bf16), torch.randn(4).to(bf16)), InputError, "bias must have shape [3]"),
    (lambda: mm_bf16(torch.randn(2, 8).to(bf16), torch.randn(8, 3).to(bf16), out=torch.empty(2, 4, dtype=bf16)), InputError, "out must have shape [2, 3]"),
    (lambda: mm_bf16(torch.randn(2, 8).to(bf16), torch.randn(8, 3).to(bf16), out=torch.empty(2, 3, dtype=f16)), InputTypeError, "out must be bfloat16"),
    (lambda: mm_bf16(torch.randn(2, 8).to(bf16), torch.randn(8, 3).to(bf16), backend="nope"), UnsupportedError, "unknown backend"),
    (lambda: bmm_bf16(torch.randn(2, 3, 8).to(bf16), torch.randn(3, 8, 4).to(bf16)), InputError, "B must have shape [2, 8, *]"),
    (lambda: bmm_fp8(torch.randn(1, 2, 16).to(bf16), torch.randn(1, 16, 4).to(e4m3), torch.ones(1), torch.ones(1), bf16), InputTypeError, "A must be float8"),
    (lambda: bmm_fp8(torch.randn(1, 2, 16).to(e4m3), torch.randn(1, 16, 4).to(e4m3), torch.ones(1, dtype=torch.float64), torch.ones(1), bf16), InputTypeError, "A_scale must be float32"),
    (lambda: bmm_fp8(torch.randn(1, 2, 16).to(e4m3), torch.randn(1, 16, 4).to(e4m3), torch.ones(1), torch.ones(2), bf16), InputError, "B_scale must hold one"),
    (lambda: bmm_fp8(torch.randn(1, 2, 16).to(e4m3), torch.randn(1, 16, 4).to(e4m3), torch.ones(1), torch.ones(1), torch.float32), InputTypeError, "dtype must be bfloat16"),
])
def test_validation_messages(call, exc, text):
    with pytest.raises(exc) as info:
        call()
    assert text in str(info.value)


def test_alignment_facts():
    def facts(a, w, out):
        st = api._strides(a, w, out)
        assert st == api._strides(a.unsqueeze(0), w.unsqueeze(0), out.unsqueeze(0))
        return api._k_ok(a, w, st), api._d_ok(out, None, st)

    assert facts(torch.empty(4, 64, dtype=bf16), torch.empty(32, 64, dtype=bf16),
                 torch.empty(4, 32, dtype=bf16)) == (True, True)
    # 120-byte rows: no 16-byte vector loads, no TMA
    assert facts(torch.empty(4, 60, dtype=bf16), torch.empty(32, 60, dtype=bf16),
                 torch.empty(4, 32, dtype=bf16))[0] is False
    # N = 30: 60-byte output rows, no TMA store
    assert facts(torch.empty(4, 64, dtype=bf16), torch.empty(30, 64, dtype=bf16),
                 torch.empty(4, 30, dtype=bf16))[1] is False
    # M = 1 with an odd stride on the size-1 dimension is still aligned
    a1 = torch.empty(64, 1, dtype=bf16).T
    assert facts(a1, torch.empty(32, 64, dtype=bf16), torch.empty(1, 32, dtype=bf16)) == (True, True)


def test_gemv_check_reasons():
    assert api._gemv_check({"m": 17, "k_ok": True}) is not None
    assert api._gemv_check({"m": 16, "k_ok": False}) is not None
    assert api._gemv_check({"m": 16, "k_ok": True}) is None
    assert api._sm90_check({"k_ok": True, "d_ok": False}) is not None


def test_dispatch_on_cpu_is_reference():
    assert api.MM_BF16.choose("cpu", bf16).name == "reference"
    assert api.BMM_FP8.choose("cpu", e4m3).name == "reference"


def test_torch_compile_fullgraph_cpu():
    a = torch.randn(5, 32).to(bf16)
    w = torch.randn(16, 32).to(bf16)
    bias = torch.randn(16).to(bf16)

    def f(a, w, bias):
        return mm_bf16(a, w.T, bias) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, w, bias), f(a, w, bias), atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["9.0a", "8.0", "8.9"])
def test_backend_reasons_per_arch(arch):
    from fi_core import Arch

    a = Arch.parse(arch)
    by_name = {b.name: b for b in api.MM_BF16.backends}
    facts = {"m": 4, "k_ok": True, "d_ok": True, "fp8": False, "arch": a}
    assert by_name["gemv"].reason("cuda", a, bf16, facts) is None
    big = dict(facts, m=4096)
    assert by_name["gemv"].reason("cuda", a, bf16, big) is not None
    sm90 = by_name["cutlass_sm90"].reason("cuda", a, bf16, big)
    assert (sm90 is None) == (arch == "9.0a")
    assert by_name["torch"].reason("cuda", a, bf16, big) is None
    assert by_name["torch"].reason("cuda", a, e4m3, big) is not None  # fp8 never goes to torch
    fp8 = {b.name: b for b in api.BMM_FP8.backends}["gemv"]
    ok = fp8.reason("cuda", a, e4m3, dict(facts, fp8=True)) is None
    assert ok == (arch != "8.0")
    # M > 16 off Hopper: the CUTLASS 2.x unit, ahead of torch in the preference order; on sm_90
    # it is allowed too (asked for by name), but the sm90 unit comes first.
    sm80 = by_name["cutlass_sm80"]
    assert sm80.reason("cuda", a, bf16, big) is None
    assert "out_dtype" in sm80.reason("cuda", a, bf16, dict(big, bias_ok=False))
    assert "aligned" in sm80.reason("cuda", a, bf16, dict(big, k_ok=False))
    fp8_sm80 = {b.name: b for b in api.BMM_FP8.backends}["cutlass_sm80"]
    assert (fp8_sm80.reason("cuda", a, e4m3, dict(big, fp8=True)) is None) == (arch != "8.0")
    names = [b.name for b in api.MM_BF16.backends]
    assert names.index("cutlass_sm90") < names.index("cutlass_sm80") < names.index("torch")
    # the representative kernel variants used by precompile / the compile check
    specs = api.MM_BF16.specs(a)
    assert [s.name for s in specs] == (
        ["gemv_bf16_bf16_bf16", "gemm_sm90_bf16_bf16_bf16_mid", "gemm_sm90_bf16_bf16_bf16_large"]
        if arch == "9.0a" else ["gemv_bf16_bf16_bf16", "gemm_sm80_bf16_bf16_bf16"])
    assert all(s.arch == a for s in specs)
    fp8_specs = [s.name for s in api.BMM_FP8.specs(a)]
    assert ("gemm_sm80_e4m3_e4m3_bf16" in fp8_specs) == (arch == "8.9")


def test_fp8_large_config_is_switchable(monkeypatch):
    """spec.FP8_LARGE picks the fp8 large-class unit (A/B runs switch it); nothing else moves."""
    from fi_gemm.dense import spec

    assert spec.sm90_config(e4m3, 8192, 8192) == "large"
    monkeypatch.setattr(spec, "FP8_LARGE", "t128x128_c2x1")
    assert spec.sm90_config(e4m3, 8192, 8192) == "t128x128_c2x1"
    assert spec.sm90_config(e5m2, 300, 64) == "t128x128_c2x1"
    assert spec.sm90_config(e4m3, 256, 8192) == "mid"
    assert spec.sm90_config(bf16, 8192, 8192) == "large"


def test_fp8_candidate_specs_are_distinct_units():
    from fi_core import Arch
    from fi_gemm.dense import spec

    a = Arch.parse("9.0a")
    cands = spec.fp8_candidate_specs(a)
    assert [s.name.rsplit("bf16_", 1)[1] for s in cands] == [
        c for c in spec.CONFIGS_FP8 if c not in ("large", "mid")]
    keys = {s.key() for s in cands} | {spec.gemm_sm90_spec(e4m3, e4m3, bf16, "large", a).key()}
    assert len(keys) == len(cands) + 1
    for name, c in spec.CONFIGS_FP8.items():
        assert c.name == name and c.tile_k == 128 and c.swizzle in (1, 2, 4, 8)
        assert c.raster in (0, 1, 2) and c.promotion % (c.tile_k // 32) == 0
    # 16-bit inputs have no promotion in their mainloop: the define says so
    assert dict(spec.gemm_sm90_spec(bf16, bf16, bf16, "large", a).defines)["FI_PROMOTION"] == "0"
    assert dict(spec.gemm_sm90_spec(e4m3, e4m3, bf16, "large", a).defines)["FI_PROMOTION"] == "8"


def test_gemv_ab_switches_name_and_define_the_module(monkeypatch):
    """spec.GEMV_AB (tools/ab_gemv.py) builds another module: its own name and -D per switch."""
    from fi_core import Arch
    from fi_gemm.dense import spec

    a = Arch.parse("9.0a")
    spec.gemv_spec.cache_clear()
    base = spec.gemv_spec(bf16, bf16, bf16, a)
    monkeypatch.setattr(spec, "GEMV_AB", {"PDL": 0, "U8": 4})
    spec.gemv_spec.cache_clear()
    try:
        ab = spec.gemv_spec(bf16, bf16, bf16, a)
    finally:
        monkeypatch.undo()
        spec.gemv_spec.cache_clear()
    assert ab.name == base.name + "_pdl0_u84" and ab.key() != base.key()
    assert dict(ab.defines)["FI_GEMV_PDL"] == "0" and dict(ab.defines)["FI_GEMV_U8"] == "4"
    assert "FI_GEMV_PDL" not in dict(base.defines)
    assert spec.gemv_spec(bf16, bf16, bf16, a).key() == base.key()


def test_bench_config_option_parsing_and_restore():
    from fi_core.bench import RoutineArgs
    from fi_gemm.dense import spec
    from fi_core.bench import config_choices, with_config

    table = spec.CONFIGS_FP8
    assert config_choices(RoutineArgs(options={}), "fp8_large", table) == []
    got = config_choices(RoutineArgs(options={"fp8_large": "large+t128x128_c2x1"}), "fp8_large", table)
    assert got == ["large", "t128x128_c2x1"]
    with pytest.raises(InputError, match="t128x128_c2x1"):
        config_choices(RoutineArgs(options={"fp8_large": "nope"}), "fp8_large", table)
    assert list(with_config(spec, "FP8_LARGE", "fp8_large", [])) == [""]
    seen = []
    for suffix in with_config(spec, "FP8_LARGE", "fp8_large", got):
        seen.append((suffix, spec.FP8_LARGE))
    assert seen == [(" [fp8_large=large]", "large"), (" [fp8_large=t128x128_c2x1]", "t128x128_c2x1")]
    assert spec.FP8_LARGE == "large"
    gen = with_config(spec, "FP8_LARGE", "fp8_large", ["t128x128_c2x1", "large"])
    next(gen)
    assert spec.FP8_LARGE == "t128x128_c2x1"
    gen.close()  # a routine that stops early (a failed row) still restores the default
    assert spec.FP8_LARGE == "large"

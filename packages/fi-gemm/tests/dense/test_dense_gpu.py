"""GPU tests of mm_bf16 / bmm_bf16 / bmm_fp8 against the fp32 reference on random inputs.

Grid reduction: M covers the decode kernel (1, 3, 16), the CUTLASS mid class (127) and the large
class (1024, 4097); N/K pairs include sizes that are not multiples of any tile (1000 x 776), and
every dtype combination is tested at a few M only. All kernel modules used here are built up
front in one parallel build (see `_warm`), so compile time is paid once.
"""

import json

import pytest
import torch

from fi_core import arch_of, load_many, testing
from fi_gemm import autotune, bmm_bf16, bmm_fp8, mm_bf16, tuning
from fi_gemm.dense import api
from fi_gemm.dense import spec as dense_spec
from fi_gemm.dense.reference import gemm_reference
from fi_gemm.warm import gpu_test_specs

pytestmark = testing.gpu_only()

bf16, f16, e4m3, e5m2 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def _warm():
    load_many(gpu_test_specs(arch_of(torch.device(DEV))))


def _operands(m, n, k, dtype, seed):
    a = testing.randn((m, k), dtype, DEV, seed=seed)
    w = testing.randn((n, k), dtype, DEV, seed=seed + 1, scale=k ** -0.5)
    return a, w


@pytest.mark.parametrize("m", [1, 3, 16, 127, 1024, 4097])
@pytest.mark.parametrize("n, k", [(256, 512), (1000, 776)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_mm_bf16(m, n, k, with_bias):
    a, w = _operands(m, n, k, bf16, seed=m + n)
    bias = testing.randn((n,), bf16, DEV, seed=7) if with_bias else None
    out = testing.empty_poisoned((m, n), bf16, DEV)
    mm_bf16(a, w.T, bias, out=out)
    testing.assert_close(out, gemm_reference(a, w, bf16, bias), dtype=bf16)


@pytest.mark.parametrize("m", [3, 1024])
def test_mm_bf16_fp16_out(m):
    a, w = _operands(m, 512, 1024, bf16, seed=3)
    out = mm_bf16(a, w.T, out_dtype=f16)
    testing.assert_close(out, gemm_reference(a, w, f16), dtype=f16)


@pytest.mark.parametrize("m", [5, 127])
def test_mm_fp16_inputs(m):
    a, w = _operands(m, 384, 640, f16, seed=4)
    out = mm_bf16(a, w.T, out_dtype=f16)
    testing.assert_close(out, gemm_reference(a, w, f16), dtype=f16)


@pytest.mark.parametrize("m", [2, 300])
def test_mm_bf16_strided_rows(m):
    """Rows of a and w padded (lda, ldw > K): the kernels must use the given strides."""
    k, n = 512, 264
    a_big = testing.randn((m, k + 64), bf16, DEV, seed=11)
    w_big = testing.randn((n, k + 128), bf16, DEV, seed=12, scale=k ** -0.5)
    a, w = a_big[:, :k], w_big[:, :k]
    out = mm_bf16(a, w.T)
    testing.assert_close(out, gemm_reference(a, w, bf16), dtype=bf16)


@pytest.mark.parametrize("m", [3, 200])
def test_mm_bf16_unaligned_k_falls_back(m):
    """K = 100 gives 200-byte rows: no TMA / vector loads; the result must still be right."""
    a, w = _operands(m, 64, 100, bf16, seed=5)
    out = mm_bf16(a, w.T)
    testing.assert_close(out, gemm_reference(a, w, bf16), dtype=bf16)


def test_mm_bf16_backend_choice():
    arch = arch_of(torch.device(DEV))
    facts = dict(k_ok=True, d_ok=True, fp8=False)
    assert api.MM_BF16.choose(DEV, bf16, m=16, **facts).name == "gemv"
    big = api.MM_BF16.choose(DEV, bf16, m=17, **facts).name
    assert big == ("cutlass_sm90" if arch.cc == 90 else "torch")
    unaligned = dict(facts, k_ok=False)
    assert api.MM_BF16.choose(DEV, bf16, m=4, **unaligned).name == "torch"


@pytest.mark.parametrize("m", [1, 130])
def test_bmm_bf16(m):
    b, n, k = 3, 264, 520
    A = testing.randn((b, m, k), bf16, DEV, seed=21)
    W = testing.randn((b, n, k), bf16, DEV, seed=22, scale=k ** -0.5)
    out = testing.empty_poisoned((b, m, n), bf16, DEV)
    bmm_bf16(A, W.transpose(-2, -1), out=out)
    testing.assert_close(out, gemm_reference(A, W, bf16), dtype=bf16)


def _fp8_operands(b, m, n, k, da, db, seed):
    A = testing.randn((b, m, k), torch.float32, DEV, seed=seed).to(da)
    W = testing.randn((b, n, k), torch.float32, DEV, seed=seed + 1).to(db)
    sa = torch.tensor([0.75], device=DEV)
    sb = torch.tensor([k ** -0.5], device=DEV)
    return A, W, sa, sb


@pytest.mark.parametrize("m", [1, 3, 16, 127, 1024])
def test_bmm_fp8_e4m3(m):
    if arch_of(torch.device(DEV)).cc < 89 and m <= 16:
        pytest.skip("fp8 MMA needs sm_89+")
    A, W, sa, sb = _fp8_operands(1, m, 1000, 1024, e4m3, e4m3, seed=m)
    out = testing.empty_poisoned((1, m, 1000), bf16, DEV)
    bmm_fp8(A, W.transpose(-2, -1), sa, sb, bf16, out=out)
    testing.assert_close(out, gemm_reference(A, W, bf16, None, sa, sb), dtype=bf16)


@pytest.mark.parametrize("m, n", [(300, 1000), (3, 4400)])
def test_bmm_fp8_long_k(m, n):
    """K = 4096 with partial M and N tiles (M = 300) and a decode-size M = 3 with N = 4400: fp32
    accumulation over 32 K blocks must stay within bf16's tolerance."""
    if arch_of(torch.device(DEV)).cc < 89 and m <= 16:
        pytest.skip("fp8 MMA needs sm_89+")
    A, W, sa, sb = _fp8_operands(1, m, n, 4096, e4m3, e4m3, seed=70)
    out = testing.empty_poisoned((1, m, n), bf16, DEV)
    bmm_fp8(A, W.transpose(-2, -1), sa, sb, bf16, out=out)
    testing.assert_close(out, gemm_reference(A, W, bf16, None, sa, sb), dtype=bf16)


@pytest.mark.parametrize("m", [3, 4097])
def test_bmm_fp8_mixed_e5m2_fp16_out_batched(m):
    if arch_of(torch.device(DEV)).cc < 89 and m <= 16:
        pytest.skip("fp8 MMA needs sm_89+")
    A, W, sa, sb = _fp8_operands(2, m, 512, 768, e4m3, e5m2, seed=40)
    out = bmm_fp8(A, W.transpose(-2, -1), sa, sb, f16)
    testing.assert_close(out, gemm_reference(A, W, f16, None, sa, sb), dtype=f16)


# The fp8 large-class unit and its A/B candidates (every CONFIGS_FP8 entry but "mid"), each switched
# in through spec.FP8_LARGE as the benchmark's fp8_large option does (monkeypatch restores it). One shape
# covers every residue: M = 320 is 3 M tiles, the last half full, so a 2x1 cluster has a CTA with
# no rows at all; N = 1088 is 9 N tiles of 128 (the same for 1x2 clusters), 6 of 192, the last
# partial either way; K = 1152 is 9 K tiles (a promotion residue at interval 8) and K = 8192 the
# benchmark's depth, where the promotion interval decides accuracy.
FP8_CANDIDATES = [c for c in dense_spec.CONFIGS_FP8 if c != "mid"]


@pytest.fixture(scope="module")
def _fp8_candidates():
    arch = testing.require_cc(90, "the CUTLASS units need sm_90a", DEV)
    load_many(dense_spec.fp8_candidate_specs(arch))


@pytest.mark.parametrize("k", [1152, 8192])
@pytest.mark.parametrize("config", FP8_CANDIDATES)
def test_bmm_fp8_large_candidates(config, k, monkeypatch, _fp8_candidates):
    monkeypatch.setattr(dense_spec, "FP8_LARGE", config)
    m, n = 320, 1088
    A, W, sa, sb = _fp8_operands(1, m, n, k, e4m3, e4m3, seed=80 + k)
    out = testing.empty_poisoned((1, m, n), bf16, DEV)
    bmm_fp8(A, W.transpose(-2, -1), sa, sb, bf16, out=out)
    testing.assert_close(out, gemm_reference(A, W, bf16, None, sa, sb), dtype=bf16)
    used = {p[1].spec.name for p in api._CHOICE.values() if p[1] is not None}
    assert f"gemm_sm90_e4m3_e4m3_bf16_{config}" in used, f"{config} did not run: {sorted(used)}"


@pytest.mark.parametrize("m", [4, 100, 512])  # gemv, stream-K mid, large
def test_cuda_graph_replay_and_determinism(m):
    a, w = _operands(m, 1024, 2048, bf16, seed=50)
    first = mm_bf16(a, w.T)
    assert torch.equal(first, mm_bf16(a, w.T)), "same inputs must give bit-identical outputs"
    out = torch.empty_like(first)
    mm_bf16(a, w.T, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mm_bf16(a, w.T, out=out)
    out.fill_(float("nan"))
    a.copy_(testing.randn((m, 2048), bf16, DEV, seed=51))
    g.replay()
    torch.cuda.synchronize()
    testing.assert_close(out, gemm_reference(a, w, bf16), dtype=bf16)


# The M = 9..16 units of the weight-streaming kernel (spec.GEMV_M16, the bench's m16=N option):
# one CTA per 16 W rows, and K split across a 2-CTA cluster with the partial sums added through
# distributed shared memory. N = 1000 leaves the last pair a partial 32-row group; K = 776 is 25
# steps of 32, split 13 + 12, the last vector of each row in the second CTA's range.
@pytest.fixture
def _fresh_dispatch():
    api.reset_dispatch()
    dense_spec.gemv_spec.cache_clear()
    yield
    api.reset_dispatch()
    dense_spec.gemv_spec.cache_clear()


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("m, n, k", [(16, 1000, 776), (9, 4096, 4096)])
def test_gemv_m16_units(mode, m, n, k, monkeypatch, _fresh_dispatch):
    testing.require_cc(90, "the units are built for sm_90 (2 uses thread-block clusters)", DEV)
    monkeypatch.setattr(dense_spec, "GEMV_M16", mode)
    dense_spec.gemv_spec.cache_clear()
    a, w = _operands(m, n, k, bf16, seed=90 + mode)
    out = testing.empty_poisoned((m, n), bf16, DEV)
    mm_bf16(a, w.T, out=out)
    testing.assert_close(out, gemm_reference(a, w, bf16), dtype=bf16)
    used = {p[1].spec.name for p in api._CHOICE.values() if p[1] is not None}
    assert f"gemv_bf16_bf16_bf16_m16v{mode}" in used, f"mode {mode} did not run: {sorted(used)}"


# Decode shapes wide enough to fill every SM (the two-slab M <= 8 unit from N = 4224, the
# M = 9..16 units from N = 2112): N not a multiple of 16 (4100: a 4-row last slab), K tails of
# one 16-byte vector (4104), a K that leaves the 2-CTA pair's second CTA no step (32), batched W
# (l = 3), bias, fp16 and fp8 operands.
WIDE_CASES = [  # (m, n, k, dtype, batch, bias)
    (1, 4100, 4104, bf16, 1, False), (8, 4400, 776, bf16, 1, True), (16, 4096, 4096, bf16, 1, True),
    (13, 2112, 520, bf16, 1, False), (16, 2112, 32, bf16, 1, False), (5, 1024, 1040, f16, 3, False),
    (11, 1024, 2056, bf16, 3, False), (16, 4096, 4096, e4m3, 1, False), (3, 4400, 1040, e4m3, 1, False),
]


@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda c: f"m{c[0]}n{c[1]}k{c[2]}b{c[4]}{c[3]}".replace("torch.", ""))
def test_gemv_wide_shapes(case):
    m, n, k, dtype, b, with_bias = case
    if dtype == e4m3:
        if arch_of(torch.device(DEV)).cc < 89:
            pytest.skip("fp8 MMA needs sm_89+")
        A, W, sa, sb = _fp8_operands(b, m, n, k, e4m3, e4m3, seed=120 + m)
        out = testing.empty_poisoned((b, m, n), bf16, DEV)
        bmm_fp8(A, W.transpose(-2, -1), sa, sb, bf16, out=out)
        ref = gemm_reference(A, W, bf16, None, sa, sb)
    else:
        A = testing.randn((b, m, k), dtype, DEV, seed=130 + m)
        W = testing.randn((b, n, k), dtype, DEV, seed=131 + m, scale=k ** -0.5)
        bias = testing.randn((n,), dtype, DEV, seed=132) if with_bias else None  # mm only
        out = testing.empty_poisoned((b, m, n), dtype, DEV)
        if b == 1:
            mm_bf16(A[0], W[0].T, bias=bias, out=out[0], out_dtype=dtype)
        else:
            bmm_bf16(A, W.transpose(-2, -1), out=out, out_dtype=dtype)
        ref = gemm_reference(A, W, dtype, bias)
    testing.assert_close(out, ref, dtype=out.dtype)


@pytest.fixture
def _tuning_file(tmp_path, monkeypatch):
    """Records in a private file (the kernel cache stays where the compiled modules are)."""
    path = tmp_path / "tuning.json"
    monkeypatch.setattr(tuning, "_path", lambda name: path)
    tuning.forget()
    api.reset_dispatch()
    yield path
    tuning.forget()
    api.reset_dispatch()


def test_autotune_times_the_table_and_later_processes_reuse_the_choice(_tuning_file, _fp8_candidates):
    m, n, k = 320, 1088, 1152
    A, W, sa, sb = _fp8_operands(1, m, n, k, e4m3, e4m3, seed=70)
    ref = gemm_reference(A, W, bf16, None, sa, sb)
    with autotune():
        tuned = bmm_fp8(A, W.transpose(-2, -1), sa, sb, bf16)
    testing.assert_close(tuned, ref, dtype=bf16)  # the call's own result comes from the chosen unit
    entry = json.loads(_tuning_file.read_text())["entries"][
        "bmm_fp8|float8_e4m3fn|float8_e4m3fn|bfloat16|320|1088|1152|1"]
    assert set(entry["us"]) == set(dense_spec.CONFIGS_FP8), entry
    assert entry["config"] == min(entry["us"], key=entry["us"].get)
    tuning.forget()  # a new process: outside any autotune() the recorded unit runs
    api.reset_dispatch()
    again = bmm_fp8(A, W.transpose(-2, -1), sa, sb, bf16)
    used = {p[1].spec.name for p in api._CHOICE.values() if p[1] is not None}
    assert used == {f"gemm_sm90_e4m3_e4m3_bf16_{entry['config']}"}, used
    assert torch.equal(again, tuned), "the same unit on the same inputs must be bit-identical"


def test_autotune_leaves_graph_capture_and_decode_shapes_alone(_tuning_file):
    a, w = _operands(300, 512, 1024, bf16, seed=71)
    out = torch.empty(300, 512, dtype=bf16, device=DEV)
    small = torch.empty(8, 512, dtype=bf16, device=DEV)
    mm_bf16(a, w.T, out=out)  # warm-up outside the capture
    mm_bf16(a[:8], w.T, out=small)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with autotune(), torch.cuda.graph(g):
        mm_bf16(a, w.T, out=out)  # capturing: no timing, the table's unit
    with autotune():
        mm_bf16(a[:8], w.T, out=small)  # M <= 16: the weight-streaming kernel, nothing to tune
    assert not _tuning_file.exists()
    g.replay()
    torch.cuda.synchronize()
    testing.assert_close(out, gemm_reference(a, w, bf16), dtype=bf16)
    testing.assert_close(small, gemm_reference(a[:8], w, bf16), dtype=bf16)


# Repeat calls of the decode shapes take the recorded fast path (api._FAST): it must give the
# checked path's results for new data, new scale values and new output buffers, and hand every
# call it cannot vouch for (misaligned data, another shape, bias, out=) back to the checks.
def test_repeat_decode_calls_take_the_fast_path_and_stay_correct():
    api.reset_dispatch()
    a, w = _operands(16, 1000, 776, bf16, seed=90)
    first = mm_bf16(a, w.T)
    assert len(api._FAST) == 1, "a checked gemv call must record its signature"
    for seed in (91, 92):
        a2, w2 = _operands(16, 1000, 776, bf16, seed=seed)
        got = mm_bf16(a2, w2.T)
        assert got.data_ptr() != first.data_ptr(), "every call returns a new output"
        testing.assert_close(got, gemm_reference(a2, w2, bf16), dtype=bf16)
    # 2 bytes past a 16-byte boundary: the fast path declines, the checked path copies nothing
    # here but must still answer correctly (and not record the misaligned call).
    buf = testing.randn((16 * 776 + 8,), bf16, DEV, seed=93)
    a_odd = buf[1: 1 + 16 * 776].view(16, 776)
    testing.assert_close(mm_bf16(a_odd, w.T), gemm_reference(a_odd, w, bf16), dtype=bf16)
    # the first call's signature with a bias or an out= goes through the checks
    bias = testing.randn((1000,), bf16, DEV, seed=94)
    testing.assert_close(mm_bf16(a, w.T, bias=bias), gemm_reference(a, w, bf16, bias), dtype=bf16)
    out = testing.empty_poisoned((16, 1000), bf16, DEV)
    mm_bf16(a, w.T, out=out)
    testing.assert_close(out, gemm_reference(a, w, bf16), dtype=bf16)


def test_repeat_bmm_fp8_calls_use_each_calls_scales():
    if arch_of(torch.device(DEV)).cc < 89:
        pytest.skip("fp8 weight streaming needs sm_89")
    api.reset_dispatch()
    A, W, sa, sb = _fp8_operands(2, 16, 1000, 768, e4m3, e4m3, seed=95)  # fp8 gemv: K % 16 == 0
    bmm_fp8(A, W.transpose(-2, -1), sa, sb, bf16)
    assert len(api._FAST) == 1
    for scale in (0.5, 2.0):
        sa2 = torch.tensor([scale], device=DEV)
        got = bmm_fp8(A, W.transpose(-2, -1), sa2, sb, bf16)
        testing.assert_close(got, gemm_reference(A, W, bf16, None, sa2, sb), dtype=bf16)


@pytest.mark.parametrize("m, n, k, with_bias", [(320, 1088, 1152, True), (4097, 1000, 776, False)])
def test_mm_bf16_pingpong_unit(m, n, k, with_bias, monkeypatch):
    """The ping-pong candidate of the 16-bit table (only the autotuner picks it), forced through
    the shape-class hook: partial tiles in M, N and K, with and without the bias."""
    testing.require_cc(90, "the CUTLASS units need sm_90a", DEV)
    monkeypatch.setattr(api, "sm90_config", lambda dtype, m, n, batch=1: "pingpong")
    api.reset_dispatch()
    a, w = _operands(m, n, k, bf16, seed=90 + m)
    bias = testing.randn((n,), bf16, DEV, seed=91) if with_bias else None
    out = testing.empty_poisoned((m, n), bf16, DEV)
    mm_bf16(a, w.T, bias=bias, out=out)
    used = {p[1].spec.name for p in api._CHOICE.values() if p[1] is not None}
    api.reset_dispatch()
    assert used == {"gemm_sm90_bf16_bf16_bf16_pingpong"}, used
    testing.assert_close(out, gemm_reference(a, w, bf16, bias), dtype=bf16)

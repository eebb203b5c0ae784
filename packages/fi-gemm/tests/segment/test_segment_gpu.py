"""GPU tests of the segment / grouped GEMM kernel against the fp32 reference.

Grid reduction: segment lengths cover 0, 1, 15, 16, 17 (tile boundaries) and 512; N covers the
LoRA shrink (16) and expand (4096 -> reduced to 1000 + odd sizes) directions.
"""

import itertools

import pytest
import torch

from fi_core import arch_of, load_many, testing
from fi_gemm import SegmentGEMMWrapper, grouped_mm_bf16
from fi_gemm.dense import spec as dense_spec
from fi_gemm.segment.reference import segment_gemm_reference
from fi_gemm.warm import gpu_test_specs

pytestmark = testing.gpu_only()


@pytest.fixture(scope="module", autouse=True)
def _warm():
    load_many(gpu_test_specs(arch_of(torch.device(DEV))))
bf16, f16 = torch.bfloat16, torch.float16
DEV = "cuda"


@pytest.mark.parametrize("lens", [[16] * 8, [0, 1, 15, 16, 17, 0, 40], [512] * 3, [33, 31, 64, 1]])
@pytest.mark.parametrize("n, k", [(16, 4096), (1000, 64), (72, 776)])
@pytest.mark.parametrize("column_major", [True, False])
def test_segment_gemm(lens, n, k, column_major):
    total = sum(lens)
    x = testing.randn((total, k), bf16, DEV, seed=1)
    w_nk = testing.randn((5, n, k), bf16, DEV, seed=2, scale=k ** -0.5)
    widx = torch.tensor([(3 * i + 1) % 5 for i in range(len(lens))], device=DEV)
    w = w_nk if column_major else w_nk.transpose(1, 2).contiguous()
    out = testing.empty_poisoned((total, n), bf16, DEV)
    seg = SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8, device=DEV))
    seg.run(x, w, len(lens), column_major, out=out,
            seg_lens=torch.tensor(lens, device=DEV), weight_indices=widx)
    ref = torch.full((total, n), float("nan"), dtype=bf16, device=DEV)
    indptr = torch.tensor(list(itertools.accumulate(lens, initial=0)), device=DEV)
    segment_gemm_reference(x, w_nk, indptr, widx, ref)
    testing.assert_close(out, ref, dtype=bf16)


def _check_column_major(lens, n, k, num_weights, seed):
    """Column-major weights, segments given by seg_indptr, weight i of segment s chosen by a
    stride that visits every weight: out against the reference."""
    total = sum(lens)
    x = testing.randn((total, k), bf16, DEV, seed=seed)
    w = testing.randn((num_weights, n, k), bf16, DEV, seed=seed + 1, scale=k ** -0.5)
    widx = torch.tensor([(5 * i + 2) % num_weights for i in range(len(lens))], device=DEV)
    indptr = torch.tensor(list(itertools.accumulate(lens, initial=0)), device=DEV)
    out = testing.empty_poisoned((total, n), bf16, DEV)
    SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8, device=DEV)).run(
        x, w, len(lens), True, out=out, seg_indptr=indptr, weight_indices=widx)
    ref = torch.empty_like(out)
    segment_gemm_reference(x, w, indptr, widx, ref)
    testing.assert_close(out, ref, dtype=bf16)


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("lens", [[512] * 3, [0, 1, 31, 32, 33, 0, 95], [40] * 70])
@pytest.mark.parametrize("n", [16, 9])
def test_segment_gemm_units(mode, lens, n, monkeypatch):
    """The N <= 16 units (dense spec.GEMV_SEG, the bench's seg=N option): 16-row tiles, and
    32-row tiles split over K by a 2-CTA cluster; tile edges at 31/32/33 rows, K = 776 (25 steps
    of 32, split 13 + 12), N = 9: a partial slab."""
    testing.require_cc(90, "the units are built for sm_90 (2 uses thread-block clusters)", DEV)
    monkeypatch.setattr(dense_spec, "GEMV_SEG", mode)
    dense_spec.gemv_spec.cache_clear()
    try:
        _check_column_major(lens, n, 776, 3, seed=8)
    finally:
        dense_spec.gemv_spec.cache_clear()


def test_segment_gemm_many_segments():
    """70 segments: the kernel finds a tile's segment 32 segments per round (three rounds here),
    with empty segments in every round and at the end (surplus tiles exit)."""
    _check_column_major([(7 * i) % 37 for i in range(69)] + [0], 24, 256, 9, seed=6)


@pytest.mark.parametrize("out_dtype", [bf16, torch.float32])
def test_grouped_mm(out_dtype):
    lens = [3, 0, 33, 130]
    ip = torch.tensor([0, 3, 3, 36, 166], dtype=torch.int32, device=DEV)
    a = testing.randn((166, 512), bf16, DEV, seed=3)
    b = testing.randn((4, 264, 512), bf16, DEV, seed=4, scale=512 ** -0.5)
    out = grouped_mm_bf16(a, b, ip, out_dtype=out_dtype)
    ref = torch.empty_like(out)
    segment_gemm_reference(a, b, ip, None, ref)
    testing.assert_close(out, ref, dtype=out_dtype if out_dtype != torch.float32 else bf16)
    assert sum(lens) == 166


def test_graph_replay():
    x = testing.randn((48, 256), f16, DEV, seed=5)
    w = testing.randn((2, 32, 256), f16, DEV, seed=6, scale=1 / 16)
    ip = torch.tensor([0, 20, 48], device=DEV)
    seg = SegmentGEMMWrapper(torch.empty(16, dtype=torch.int8, device=DEV))
    out = seg.run(x, w, 2, True, seg_indptr=ip)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        seg.run(x, w, 2, True, out=out, seg_indptr=ip)
    ip.copy_(torch.tensor([0, 40, 48], device=DEV))  # new lengths, same graph
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = torch.empty_like(out)
    segment_gemm_reference(x, w, ip, None, ref)
    testing.assert_close(out, ref, dtype=f16)


def test_grouped_mm_host_sizes_path():
    """m_sizes given: each group runs the dense path (gemv for 3 rows, CUTLASS/torch for 130)."""
    lens = [3, 0, 130]
    ip = torch.tensor([0, 3, 3, 133], device=DEV)
    a = testing.randn((133, 512), bf16, DEV, seed=8)
    b = testing.randn((3, 264, 512), bf16, DEV, seed=9, scale=512 ** -0.5)
    out = testing.empty_poisoned((133, 264), bf16, DEV)
    grouped_mm_bf16(a, b, ip, out=out, m_sizes=lens)
    ref = torch.empty_like(out)
    segment_gemm_reference(a, b, ip, None, ref)
    testing.assert_close(out, ref, dtype=bf16)


# Repeat run() calls of one signature take the recorded fast path (segment.api._FAST): new data,
# new segment offsets and new weight indices must give the checked path's results; seg_lens (a
# cumsum per call) and int32 offsets (a conversion per call) always take the checks.
@pytest.mark.parametrize("column_major", [True, False])
def test_repeat_segment_calls_take_the_fast_path_and_stay_correct(column_major):
    from fi_gemm.segment import api  # noqa: PLC0415

    api.reset_dispatch()
    n, k, total = 16, 1024, 96
    seg = SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8, device=DEV))

    def call(seed, ip, widx, i32=False):
        x = testing.randn((total, k), bf16, DEV, seed=seed)
        w_nk = testing.randn((4, n, k), bf16, DEV, seed=seed + 1, scale=k ** -0.5)
        w = w_nk if column_major else w_nk.transpose(1, 2).contiguous()
        indptr = torch.tensor(ip, device=DEV, dtype=torch.int32 if i32 else torch.int64)
        wi = torch.tensor(widx, device=DEV)
        got = seg.run(x, w, len(ip) - 1, column_major, seg_indptr=indptr, weight_indices=wi)
        ref = testing.empty_poisoned((total, n), bf16, DEV)
        segment_gemm_reference(x, w_nk, indptr.long(), wi, ref)
        rows = slice(ip[0], ip[-1])
        testing.assert_close(got[rows], ref[rows], dtype=bf16)

    # Row-major weights are copied (transposed) on every call, so only column-major ones record.
    recorded = 1 if column_major else 0
    call(10, [0, 40, 40, 96], [3, 0, 1])
    assert len(api._FAST) == recorded, "a checked call without copies must record its signature"
    call(12, [0, 7, 60, 96], [1, 2, 3])
    call(14, [4, 20, 50, 90], [0, 0, 2])
    call(16, [0, 40, 40, 96], [3, 0, 1], i32=True)
    assert len(api._FAST) == recorded, "int32 offsets are converted, so that call is not recorded"

"""CPU tests of SegmentGEMMWrapper / grouped_mm_bf16: validation, the reference against a naive
per-row formula, both weight layouts, empty segments, torch.compile tracing."""

import pytest
import torch

from fi_core.errors import InputError, InputTypeError, UnsupportedError
from fi_gemm import SegmentGEMMWrapper, grouped_mm_bf16
from fi_gemm.segment.reference import segment_gemm_reference

bf16 = torch.bfloat16


def _naive(x, w, lens, widx):
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    r = 0
    for s, n in enumerate(lens):
        for i in range(r, r + n):
            for j in range(w.shape[1]):
                out[i, j] = sum(float(x[i, k]) * float(w[widx[s], j, k]) for k in range(x.shape[1]))
        r += n
    return out


def test_reference_matches_naive_with_empty_segment():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 6, generator=g).to(bf16)
    w = torch.randn(3, 4, 6, generator=g).to(bf16)
    lens, widx = [2, 0, 5], [2, 1, 0]
    out = torch.zeros(7, 4, dtype=torch.float32)
    segment_gemm_reference(x, w, torch.tensor([0, 2, 2, 7]), torch.tensor(widx), out)
    torch.testing.assert_close(out.double(), _naive(x, w, lens, widx), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("column_major", [True, False])
def test_wrapper_cpu_both_layouts(column_major):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 32, generator=g).to(bf16)
    w_nk = torch.randn(2, 16, 32, generator=g).to(bf16)
    w = w_nk if column_major else w_nk.transpose(1, 2).contiguous()
    seg = SegmentGEMMWrapper(torch.empty(16, dtype=torch.int8))
    y = seg.run(x, w, 3, column_major, seg_lens=torch.tensor([3, 0, 6]),
                weight_indices=torch.tensor([1, 0, 0]))
    expect = torch.zeros(9, 16, dtype=torch.float64)
    expect[:3] = x[:3].double() @ w_nk[1].double().T
    expect[3:] = x[3:].double() @ w_nk[0].double().T
    torch.testing.assert_close(y.double(), expect, atol=0.05, rtol=0.02)


def test_seg_indptr_and_lens_agree():
    x = torch.randn(8, 16).to(bf16)
    w = torch.randn(2, 8, 16).to(bf16)
    seg = SegmentGEMMWrapper(torch.empty(16, dtype=torch.int8))
    a = seg.run(x, w, 2, True, seg_lens=torch.tensor([5, 3], dtype=torch.int32))
    b = seg.run(x, w, 2, True, seg_indptr=torch.tensor([0, 5, 8]))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_grouped_mm_cpu():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(6, 32, generator=g).to(bf16)
    b = torch.randn(2, 8, 32, generator=g).to(bf16)
    y = grouped_mm_bf16(a, b, torch.tensor([0, 2, 6], dtype=torch.int32), out_dtype=torch.float32)
    ref = torch.cat([a[:2].float() @ b[0].float().T, a[2:].float() @ b[1].float().T])
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call, exc, text", [
    (lambda s: s.run(torch.randn(4, 8), torch.randn(1, 2, 8), 1, True, seg_lens=torch.tensor([4])), InputTypeError, "x must be bfloat16"),
    (lambda s: s.run(torch.randn(4, 8).to(bf16), torch.randn(1, 2, 7).to(bf16), 1, True, seg_lens=torch.tensor([4])), InputError, "weights must have shape [*, *, 8]"),
    (lambda s: s.run(torch.randn(4, 8).to(bf16), torch.randn(1, 2, 8).to(bf16), 1, True), InputError, "one of seg_lens or seg_indptr"),
    (lambda s: s.run(torch.randn(4, 8).to(bf16), torch.randn(1, 2, 8).to(bf16), 1, True, seg_lens=torch.tensor([4.0])), InputTypeError, "seg_lens must be int32 or int64"),
    (lambda s: s.run(torch.randn(4, 8).to(bf16), torch.randn(1, 2, 8).to(bf16), 2, True, seg_indptr=torch.tensor([0, 4])), InputError, "seg_indptr must have shape [3]"),
    (lambda s: s.run(torch.randn(4, 8).to(bf16), torch.randn(1, 2, 8).to(bf16), 2, True, seg_lens=torch.tensor([2, 2])), InputError, "weights needs >= batch_size"),
])
def test_validation(call, exc, text):
    with pytest.raises(exc) as info:
        call(SegmentGEMMWrapper(torch.empty(16, dtype=torch.int8)))
    assert text in str(info.value)


def test_unknown_backend():
    seg = SegmentGEMMWrapper(torch.empty(16, dtype=torch.int8), backend="bogus")
    with pytest.raises(UnsupportedError):
        seg.run(torch.randn(4, 8).to(bf16), torch.randn(1, 2, 8).to(bf16), 1, True,
                seg_lens=torch.tensor([4]))


def test_torch_compile_fullgraph_cpu():
    a = torch.randn(6, 32).to(bf16)
    b = torch.randn(2, 8, 32).to(bf16)
    ip = torch.tensor([0, 2, 6])

    def f(a, b, ip):
        return grouped_mm_bf16(a, b, ip) + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, b, ip), f(a, b, ip), atol=0, rtol=0)


def test_grouped_mm_m_sizes_is_ignored_on_cpu_and_agrees():
    a = torch.randn(6, 32).to(bf16)
    b = torch.randn(2, 8, 32).to(bf16)
    ip = torch.tensor([0, 2, 6])
    torch.testing.assert_close(grouped_mm_bf16(a, b, ip, m_sizes=[2, 4]), grouped_mm_bf16(a, b, ip),
                               atol=0, rtol=0)

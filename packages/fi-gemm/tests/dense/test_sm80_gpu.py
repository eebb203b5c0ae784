"""GPU tests of the CUTLASS 2.x unit (gemm_sm80.cu, the M > 16 path of Ampere / Ada) against the
fp32 reference. On the H200 it runs when asked for by name (sm_90 executes sm_80 / sm_89 code);
on an sm_80 / sm_89 GPU the same calls take it by default. Shapes cover partial tiles in M, N
and K (M = 17 / 127 / 4097, N = 1000, K = 776 / 520), the batched mode, both epilogue forms
(with and without the bias source) and the scales of bmm_fp8."""

import pytest
import torch

from fi_core import arch_of, testing
from fi_gemm import bmm_bf16, bmm_fp8, mm_bf16
from fi_gemm.dense import api
from fi_gemm.dense.reference import gemm_reference

pytestmark = testing.gpu_only()

bf16, f16, e4m3, e5m2 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
DEV = "cuda"


def _ran() -> set:
    """Names of the backends the dispatch memo holds (each test starts from an empty memo)."""
    return {p[0] for p in api._CHOICE.values()}


@pytest.fixture(autouse=True)
def _fresh():
    api.reset_dispatch()
    yield
    api.reset_dispatch()


@pytest.mark.parametrize("m", [17, 127, 1024, 4097])
@pytest.mark.parametrize("n, k", [(256, 512), (1000, 776), (4096, 4096)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_mm_bf16_sm80(m, n, k, with_bias):
    a = testing.randn((m, k), bf16, DEV, seed=m + n)
    w = testing.randn((n, k), bf16, DEV, seed=k, scale=k ** -0.5)
    bias = testing.randn((n,), bf16, DEV, seed=5) if with_bias else None
    out = testing.empty_poisoned((m, n), bf16, DEV)
    mm_bf16(a, w.T, bias=bias, out=out, backend="cutlass_sm80")
    assert _ran() == {"cutlass_sm80"}
    testing.assert_close(out, gemm_reference(a, w, bf16, bias), dtype=bf16)


@pytest.mark.parametrize("dtype, out_dtype", [(f16, f16), (bf16, f16)])
def test_mm_sm80_other_dtypes(dtype, out_dtype):
    m, n, k = 300, 264, 520
    a = testing.randn((m, k), dtype, DEV, seed=31)
    w = testing.randn((n, k), dtype, DEV, seed=32, scale=k ** -0.5)
    out = testing.empty_poisoned((m, n), out_dtype, DEV)
    mm_bf16(a, w.T, out=out, out_dtype=out_dtype, backend="cutlass_sm80")
    assert _ran() == {"cutlass_sm80"}
    testing.assert_close(out, gemm_reference(a, w, out_dtype), dtype=out_dtype)


def test_bias_of_another_dtype_is_declined_with_a_reason():
    """The unit adds the bias as its epilogue source in the output dtype: a bf16 bias with an
    fp16 output cannot go there, so asking for the unit by name is a clear error, and the
    default dispatch off Hopper would take torch instead."""
    a = testing.randn((64, 256), bf16, DEV, seed=1)
    w = testing.randn((128, 256), bf16, DEV, seed=2)
    bias = testing.randn((128,), bf16, DEV, seed=3)
    with pytest.raises(Exception, match="out_dtype"):
        mm_bf16(a, w.T, bias=bias, out_dtype=f16, backend="cutlass_sm80")


def test_bmm_bf16_sm80_batched():
    b, m, n, k = 3, 129, 264, 520
    A = testing.randn((b, m, k), bf16, DEV, seed=21)
    W = testing.randn((b, n, k), bf16, DEV, seed=22, scale=k ** -0.5)
    out = testing.empty_poisoned((b, m, n), bf16, DEV)
    bmm_bf16(A, W.transpose(-2, -1), out=out, backend="cutlass_sm80")
    assert _ran() == {"cutlass_sm80"}
    testing.assert_close(out, gemm_reference(A, W, bf16), dtype=bf16)


@pytest.mark.parametrize("b, m, n, k, da, db, out_dtype", [
    (1, 127, 1000, 1024, e4m3, e4m3, bf16),
    (1, 4097, 4096, 4096, e4m3, e4m3, bf16),
    (2, 300, 264, 1152, e4m3, e5m2, f16),
])
def test_bmm_fp8_sm80(b, m, n, k, da, db, out_dtype):
    if arch_of(torch.device(DEV)).cc < 89:
        pytest.skip("fp8 MMA needs sm_89+")
    A = testing.randn((b, m, k), torch.float32, DEV, seed=m).to(da)
    W = testing.randn((b, n, k), torch.float32, DEV, seed=m + 1).to(db)
    sa = torch.tensor([0.75], device=DEV)
    sb = torch.tensor([k ** -0.5], device=DEV)
    out = testing.empty_poisoned((b, m, n), out_dtype, DEV)
    bmm_fp8(A, W.transpose(-2, -1), sa, sb, out_dtype, out=out, backend="cutlass_sm80")
    assert _ran() == {"cutlass_sm80"}
    testing.assert_close(out, gemm_reference(A, W, out_dtype, None, sa, sb), dtype=out_dtype)

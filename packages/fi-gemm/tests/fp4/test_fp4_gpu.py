"""GPU tests of mm_fp4, its FP4 weight-streaming kernel and its dequantiser against the fp32
references.

Grid reduction: M covers the FP4 weight-streaming kernel (1, 3: one 8-token MMA tile; 9, 16: two)
and the dequantise + CUTLASS path (17, 127, 1024); N = 1000 ends inside a 16-row slab and a 128-row
scale tile; K = 800 has 50 NVFP4 / 25 MXFP4 scale columns (a partial 4-column tile of the swizzled
layouts) and ends inside a 128-wide K step; N = K = 4096 is a model layer. Formats: NVFP4 with a's
scales in the 128x4 and 8x4 layouts, MXFP4.
"""

import pytest
import torch

from fi_core import arch_of, load, load_many, testing
from fi_gemm import fp4_quantize, mm_fp4
from fi_gemm.fp4 import api as fp4_api
from fi_gemm.fp4.reference import dequantize_fp4, mm_fp4_reference, sf_shape
from fi_gemm.dense.spec import gemm_sm90_spec, gemv_spec
from fi_gemm.fp4.spec import dequant_spec, gemv_fp4_spec

pytestmark = testing.gpu_only()
DEV = "cuda"
bf16 = torch.bfloat16
_FMT = {"nvfp4": (16, False, False), "nvfp4_8x4": (16, False, True), "mxfp4": (32, True, False)}


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """The dequantiser and the bf16 GEMM units these shapes reach."""
    arch = arch_of(torch.device(DEV))
    specs = [dequant_spec(arch), gemv_fp4_spec(bf16, arch), gemv_fp4_spec(torch.float16, arch),
             gemv_spec(bf16, bf16, bf16, arch), gemv_spec(bf16, bf16, torch.float16, arch)]
    if arch.cc == 90:
        specs += [gemm_sm90_spec(bf16, bf16, out, cfg, arch) for out in (bf16, torch.float16)
                  for cfg in ("mid", "large")]
    load_many(specs)


def _random_bytes(shape, seed, low=0, high=256):
    g = testing.generator(seed, DEV)
    return torch.randint(low, high, shape, generator=g, device=DEV, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize("layout", ["128x4", "8x4", "linear"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows, k", [(1, 32), (130, 800), (300, 4096)])
def test_dequant_kernel_is_exact(layout, fmt, rows, k):
    """Every code and (finite) scale byte: the kernel's bf16 equals the fp32 reference exactly."""
    block, ue8m0, _ = _FMT[fmt]
    pr, pc = sf_shape(rows, k // block, layout)
    q = _random_bytes((rows, k // 2), rows + k)
    if ue8m0:
        sf = _random_bytes((pr * pc,), 7, 100, 160)
    else:  # e4m3 without its NaN bytes 0x7f / 0xff
        sf = _random_bytes((pr * pc,), 7, 0, 255)
        sf[(sf & 0x7F) == 0x7F] = 0x38
    mod = load(dequant_spec(arch_of(torch.device(DEV))))
    got = fp4_api._dequant(mod, q, sf, k, block, layout, ue8m0, torch.cuda.current_stream().cuda_stream)
    want = dequantize_fp4(q, sf, block, ue8m0, layout)
    assert torch.equal(got.float(), want)  # exact: code * scale fits bf16


def _operands(m, n, k, fmt, seed):
    block, ue8m0, use_8x4 = _FMT[fmt]
    x = testing.randn((m, k), torch.float32, DEV, seed=seed)
    w = testing.randn((n, k), torch.float32, DEV, seed=seed + 1)
    if ue8m0:
        return (*fp4_quantize(x, None, 32, True), *fp4_quantize(w, None, 32, True), None)
    gx, gw = (448 * 6 / x.abs().amax()).reshape(1), (448 * 6 / w.abs().amax()).reshape(1)
    a, sa = fp4_quantize(x, gx, 16, False, True, use_8x4)
    b, sb = fp4_quantize(w, gw, 16, False)
    return a, sa, b, sb, (1 / (gx * gw)).float()


@pytest.mark.parametrize("m", [1, 3, 9, 16, 17, 127, 1024])
@pytest.mark.parametrize("n, k", [(1000, 800), (4096, 4096)])
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_8x4", "mxfp4"])
def test_mm_fp4(m, n, k, fmt):
    _check_mm(m, n, k, fmt, "auto")


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_mm_fp4_dequant_path_at_decode_shapes(m, fmt):
    """The dequantise + bf16 GEMM path by name where auto takes the FP4 weight-streaming kernel."""
    _check_mm(m, 1000, 800, fmt, "dequant_bf16")


def test_mm_fp4_k_not_multiple_of_32():
    """NVFP4 K = 784: the weight-streaming kernel wants whole 32-code chunks, the dequantise path
    takes the call."""
    _check_mm(4, 256, 784, "nvfp4", "auto")


def _check_mm(m, n, k, fmt, backend):
    block, ue8m0, use_8x4 = _FMT[fmt]
    a, sa, b, sb, alpha = _operands(m, n, k, fmt, seed=m + n)
    out = testing.empty_poisoned((m, n), bf16, DEV)
    mm_fp4(a, b.T, sa, sb.T, alpha, out=out, block_size=block, use_8x4_sf_layout=use_8x4,
           use_nvfp4=not ue8m0, backend=backend)
    ref = mm_fp4_reference(a, b, sa, sb, alpha, torch.float32, block, ue8m0, "8x4" if use_8x4 else "128x4")
    # outputs are O(sqrt(k)) (alpha undoes the global scales); compare relative to that scale
    testing.assert_close(out.float() / k ** 0.5, ref / k ** 0.5, dtype=bf16)


@pytest.mark.parametrize("m", [2, 12, 64])
def test_mm_fp4_fp16_out_row_major_b_and_no_alpha(m):
    """Without alpha the global scales stay in the result, so these operands have none (1)."""
    x = testing.randn((m, 512), torch.float32, DEV, seed=5)
    w = testing.randn((256, 512), torch.float32, DEV, seed=6)
    (a, sa), (b, sb) = fp4_quantize(x), fp4_quantize(w)
    got = mm_fp4(a, b.T.contiguous(), sa, sb, None, torch.float16)
    ref = mm_fp4_reference(a, b, sa, sb, None, torch.float32, 16, False)
    assert got.dtype == torch.float16
    testing.assert_close(got.float() / ref.abs().max(), ref / ref.abs().max(), dtype=torch.float16)


def test_mm_fp4_cuda_graph_replay():
    a, sa, b, sb, alpha = _operands(16, 1024, 1024, "nvfp4", seed=9)
    eager = mm_fp4(a, b.T, sa, sb.T, alpha)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mm_fp4(a, b.T, sa, sb.T, alpha)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_mm_fp4_weight_view_and_out_stride():
    """A weight that is a row slice of a larger packed tensor (row stride > k / 2) and an output
    view with a row stride > n, through the weight-streaming kernel."""
    a, sa, b, sb, alpha = _operands(5, 512, 1024, "nvfp4", seed=11)
    wide = torch.zeros((512, 1024), dtype=torch.uint8, device=DEV)
    wide[:, :512] = b
    big = testing.empty_poisoned((5, 700), bf16, DEV)
    out = big[:, :512]
    mm_fp4(a, wide[:, :512].T, sa, sb.T, alpha, out=out)
    ref = mm_fp4_reference(a, b, sa, sb, alpha, torch.float32, 16, False)
    testing.assert_close(out.float() / 32, ref / 32, dtype=bf16)

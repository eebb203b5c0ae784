"""CPU tests of the FP4 formats and mm_fp4's reference path: code decoding, the scale layouts'
offsets (hand-computed cases and bijectivity), the quantiser's rounding (ties to even, saturation,
signed zero, NVFP4 and MXFP4 scales), mm_fp4 against the unquantised product, validation, and the
FlashInfer names."""

import pytest
import torch

import flashinfer
from fi_core.errors import InputError, InputTypeError, UnsupportedError
from fi_gemm import SfLayout, fp4_quantize, mm_fp4, mxfp4_quantize, nvfp4_quantize
from fi_gemm.fp4.reference import (E2M1_MAGNITUDES, dequantize_fp4, logical_scales, sf_offsets, sf_shape,
                                   unpack_e2m1)


def test_unpack_every_byte():
    got = unpack_e2m1(torch.arange(256, dtype=torch.uint8).view(256, 1))
    for byte in range(256):
        lo, hi = byte & 15, byte >> 4
        want = [(-1.0 if c & 8 else 1.0) * E2M1_MAGNITUDES[c & 7] for c in (lo, hi)]
        assert got[byte].tolist() == want
    assert torch.signbit(got[8, 0])  # code 8 is -0


@pytest.mark.parametrize("layout, r, c, cols, want", [
    ("128x4", 0, 0, 8, 0), ("128x4", 1, 0, 8, 16), ("128x4", 32, 0, 8, 4), ("128x4", 0, 3, 8, 3),
    ("128x4", 33, 5, 8, 512 + 16 + 4 + 1), ("128x4", 130, 6, 8, 2 * 512 + 512 + 2 * 16 + 2),
    ("128x4", 5, 2, 3, 5 * 16 + 2),  # 3 columns pad to one 4-column tile
    ("8x4", 9, 5, 8, 2 * 32 + 32 + 4 + 1), ("linear", 3, 2, 7, 23),
])
def test_scale_offsets_by_hand(layout, r, c, cols, want):
    assert int(sf_offsets(r + 1, cols, layout)[r, c]) == want


@pytest.mark.parametrize("layout", ["128x4", "8x4", "linear"])
@pytest.mark.parametrize("rows, cols", [(1, 1), (129, 7), (300, 16)])
def test_scale_offsets_are_injective_and_in_range(layout, rows, cols):
    off = sf_offsets(rows, cols, layout).flatten()
    pr, pc = sf_shape(rows, cols, layout)
    assert off.unique().numel() == off.numel() and int(off.max()) < pr * pc and int(off.min()) >= 0


def test_quantize_rounding_ties_and_saturation():
    # Block amax 6 with global scale 1 gives the scale e4m3(1) = 1, so codes are e2m1(x) itself.
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 0.3, -5.1, 2.9, 1.0, -6.0, 0.0, 4.4]
    q, sf = fp4_quantize(torch.tensor([vals]), torch.ones(1), is_sf_swizzled_layout=False)
    codes = unpack_e2m1(q)[0].tolist()
    assert codes == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 0.5, -6.0, 3.0, 1.0, -6.0, 0.0, 4.0]
    assert torch.signbit(unpack_e2m1(q)[0, 8])  # -0.1 keeps its sign
    assert sf.shape == (1, 1) and sf.view(torch.float8_e4m3fn).float().item() == 1.0


def test_quantize_nvfp4_scales_and_codes_per_block():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g) * 3
    gs = torch.tensor([2.5])
    q, sf = fp4_quantize(x, gs)
    s = logical_scales(sf, 5, 4, "128x4", ue8m0=False)
    amax = x.view(5, 4, 16).abs().amax(-1)
    torch.testing.assert_close(s, (2.5 * amax / 6).to(torch.float8_e4m3fn).float())
    grid = torch.tensor(E2M1_MAGNITUDES)
    y = (x.view(5, 4, 16) * (2.5 / s).unsqueeze(-1)).abs()
    got = unpack_e2m1(q).abs().view(5, 4, 16)
    # every code is a nearest grid point of the scaled value
    best = (y.unsqueeze(-1) - grid).abs().amin(-1)
    assert torch.all((y - got).abs() <= best + 1e-6)


def test_quantize_mxfp4_power_of_two_scales():
    x = torch.tensor([[0.3] * 31 + [12.0], [0.0] * 32])
    q, sf = mxfp4_quantize(x)
    s = logical_scales(sf, 2, 1, "128x4", ue8m0=True)
    assert s[0, 0].item() == 2.0  # 12 / 6 = 2 exactly
    assert s[1, 0].item() == 2.0 ** -127  # an all-zero block keeps the smallest scale
    torch.testing.assert_close(dequantize_fp4(q, sf, 32, True, "128x4")[0, -1], torch.tensor(12.0))
    assert torch.all(dequantize_fp4(q, sf, 32, True, "128x4")[1] == 0)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_8x4", "mxfp4"])
@pytest.mark.parametrize("m, n, k", [(1, 20, 64), (37, 50, 256), (130, 9, 96)])
def test_mm_fp4_cpu_close_to_unquantised(fmt, m, n, k):
    if fmt == "mxfp4" and k % 32:
        pytest.skip("MXFP4 blocks are 32 wide")
    g = torch.Generator().manual_seed(m + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    if fmt == "mxfp4":
        (a, sa), (b, sb) = mxfp4_quantize(x), mxfp4_quantize(w)
        out = mm_fp4(a, b.T, sa, sb.T, None, torch.float16, block_size=32, use_nvfp4=False)
    else:
        gx, gw = (448 * 6 / x.abs().amax()).reshape(1), (448 * 6 / w.abs().amax()).reshape(1)
        lay = SfLayout.layout_8x4 if fmt == "nvfp4_8x4" else SfLayout.layout_128x4
        (a, sa), (b, sb) = nvfp4_quantize(x, gx, lay), nvfp4_quantize(w, gw)
        out = mm_fp4(a, b.T, sa, sb.T, 1 / (gx * gw), use_8x4_sf_layout=fmt == "nvfp4_8x4")
        assert out.dtype == torch.bfloat16
    ref = x @ w.T
    # FP4 keeps ~10 % relative error per element; a wrong scale or layout would be far off
    assert (out.float() - ref).norm() / ref.norm() < 0.25


def test_mm_fp4_b_row_major_and_out():
    g = torch.Generator().manual_seed(3)
    a, sa = fp4_quantize(torch.randn(3, 64, generator=g))
    b, sb = fp4_quantize(torch.randn(8, 64, generator=g))
    want = mm_fp4(a, b.T, sa, sb.T)
    out = torch.empty(3, 8, dtype=torch.bfloat16)
    assert mm_fp4(a, b.T.contiguous(), sa, sb, out=out) is out
    assert torch.equal(out, want)


def test_quantize_scale_edges():
    """UE8M0 exponent exactly at and just above a power of two, a NaN block (scale NaN, codes 0),
    an inf block (largest scale), a zero block."""
    x = torch.zeros(5, 32)
    x[0, 0] = 6.0
    x[1, 0] = 6.0 * (1 + 2 ** -20)
    x[2, 1], x[2, 2] = float("nan"), 3.0
    x[3, 0] = float("inf")
    q, sf = fp4_quantize(x, None, 32, True, False)
    assert sf.flatten().tolist() == [127, 128, 255, 254, 0]
    assert q[2].eq(0).all() and q[0, 0] == 7 and q[3, 0] == 7
    q, sf = fp4_quantize(x, torch.ones(1), 16, False, False)
    assert sf[2, 0] == 0x7F and q[2].eq(0).all()  # e4m3 NaN, codes 0
    assert sf[3, 0] == 0x7E  # 448


def test_torch_compile_fullgraph_cpu():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(5, 64, generator=g), torch.randn(24, 64, generator=g)
    gx, gw = (448 * 6 / x.abs().amax()).reshape(1), (448 * 6 / w.abs().amax()).reshape(1)
    (a, sa), (b, sb) = nvfp4_quantize(x, gx), nvfp4_quantize(w, gw)
    alpha = 1 / (gx * gw)

    def f(a, b, sa, sb, alpha):
        return mm_fp4(a, b.T, sa, sb.T, alpha) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, b, sa, sb, alpha), f(a, b, sa, sb, alpha), atol=0, rtol=0)

    def g(x, gx):  # the quantiser too (its custom op on CPU runs the recipe)
        return fp4_quantize(x, gx)

    cq, csf = torch.compile(g, fullgraph=True, backend="aot_eager")(x, gx)
    assert torch.equal(cq, a) and torch.equal(csf, sa)


def _operands():
    a, sa = fp4_quantize(torch.randn(4, 64))
    b, sb = fp4_quantize(torch.randn(8, 64))
    return a, b.T, sa, sb.T


def test_mm_fp4_validation():
    a, b, sa, sb = _operands()
    with pytest.raises(InputTypeError, match="a must be"):
        mm_fp4(a.float(), b, sa, sb)
    with pytest.raises(InputError, match=r"b must be \[k / 2, n\]"):
        mm_fp4(a, b[:16], sa, sb)
    with pytest.raises(UnsupportedError, match="block_size 16"):
        mm_fp4(a, b, sa, sb, block_size=32)
    with pytest.raises(UnsupportedError, match="block_size 32"):
        mm_fp4(a, b, sa, sb, use_nvfp4=False)
    with pytest.raises(InputError, match="a_descale must hold 128 x 4"):
        mm_fp4(a, b, sa[:64], sb)
    with pytest.raises(InputError, match="contiguous scale buffer"):
        mm_fp4(a, b, sa[:, ::2], sb)
    with pytest.raises(InputError, match="alpha must hold one per-tensor scale"):
        mm_fp4(a, b, sa, sb, alpha=torch.ones(2))
    with pytest.raises(InputTypeError, match="alpha must be float32"):
        mm_fp4(a, b, sa, sb, alpha=torch.ones(1, dtype=torch.float64))
    with pytest.raises(InputTypeError, match="out_dtype"):
        mm_fp4(a, b, sa, sb, out_dtype=torch.float32)
    with pytest.raises(UnsupportedError, match="unknown backend"):
        mm_fp4(a, b, sa, sb, backend="magic")
    with pytest.raises(InputError, match="multiple of sf_vec_size"):
        fp4_quantize(torch.randn(2, 24))
    with pytest.raises(UnsupportedError, match="do_shuffle"):
        nvfp4_quantize(torch.randn(2, 32), torch.ones(1), do_shuffle=True)


def test_flashinfer_names():
    assert flashinfer.gemm.mm_fp4 is mm_fp4 and flashinfer.mm_fp4 is mm_fp4
    assert flashinfer.fp4_quantize is fp4_quantize and flashinfer.nvfp4_quantize is nvfp4_quantize
    assert flashinfer.SfLayout is SfLayout


def test_docstring_examples_run():
    import doctest

    from fi_gemm.fp4 import api, quant

    for mod in (api, quant):
        res = doctest.testmod(mod, extraglobs={"torch": torch})
        assert res.attempted > 0 and res.failed == 0, f"{mod.__name__}: {res.failed} example(s) failed"


def test_flashinfer_fp4_quantization_module():
    from flashinfer import fp4_quantization

    assert fp4_quantization.fp4_quantize is fp4_quantize and fp4_quantization.SfLayout is SfLayout
    assert fp4_quantization.mxfp4_quantize is mxfp4_quantize

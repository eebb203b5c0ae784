"""GPU tests of fp4_quantize's kernel against the torch recipe, and of mm_fp4, its FP4
weight-streaming kernel and its dequantiser against the fp32 references.

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
from fi_gemm.fp4.spec import dequant_spec, gemv_fp4_spec, quant_spec

pytestmark = testing.gpu_only()
DEV = "cuda"
bf16 = torch.bfloat16
_FMT = {"nvfp4": (16, False, False), "nvfp4_8x4": (16, False, True), "mxfp4": (32, True, False)}


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """The dequantiser and the bf16 GEMM units these shapes reach."""
    arch = arch_of(torch.device(DEV))
    specs = [quant_spec(arch), dequant_spec(arch), gemv_fp4_spec(bf16, arch),
             gemv_fp4_spec(torch.float16, arch), gemv_spec(bf16, bf16, bf16, arch), gemv_spec(bf16, bf16, torch.float16, arch)]
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


def _quant_input(rows, k, dtype, seed):
    """Blocks of random magnitude (2^-30 .. 2^30 per 16 elements), exact e2m1 ties (grid points
    times a power of two), zero, subnormal and signed-zero blocks; NaN / inf in one block each."""
    x = testing.randn((rows, k), torch.float32, "cpu", seed=seed)
    g = testing.generator(seed)
    mag = torch.randint(-30, 31, (rows, k // 16), generator=g).float().exp2()
    if dtype == torch.float16:
        mag = mag.clamp(2.0 ** -10, 2.0 ** 10)
    x = (x.view(rows, k // 16, 16) * mag.unsqueeze(-1)).view(rows, k)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5,
                         -3.5, -5.0, -6.0])
    x[0, :16] = ties * 4  # amax 24: scale 4 in both formats, each value a tie on the code grid
    if k >= 64:
        x[0, 16:32] = 0.0
        x[0, 32:48] = -0.0
        x[0, 48:64] = 1e-40 if dtype == torch.float32 else 0.0
    if rows > 2:
        x[1, 5] = float("nan")
        x[2, 3] = float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [bf16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt, layout", [("nvfp4", "128x4"), ("nvfp4", "8x4"), ("nvfp4", "linear"),
                                         ("nvfp4_nogs", "128x4"), ("mxfp4", "128x4"), ("mxfp4", "linear")])
@pytest.mark.parametrize("rows, k", [(1, 32), (37, 64), (130, 800), (300, 4096)])
def test_quantize_kernel_matches_the_torch_recipe(dtype, fmt, layout, rows, k):
    """fp4_quantize's kernel against the torch ops on the CPU, byte for byte (codes and the whole
    padded scale buffer)."""
    block, ue8m0 = (32, True) if fmt == "mxfp4" else (16, False)
    x = _quant_input(rows, k, dtype, rows + k)
    gs = None if fmt != "nvfp4" else torch.tensor([448 * 6 / 40.0])
    sw, l8 = layout != "linear", layout == "8x4"
    q, sf = fp4_quantize(x.to(DEV), None if gs is None else gs.to(DEV), block, ue8m0, sw, l8)
    rq, rsf = fp4_quantize(x, gs, block, ue8m0, sw, l8)
    assert q.shape == rq.shape and sf.shape == rsf.shape
    assert torch.equal(sf.cpu(), rsf)
    assert torch.equal(q.cpu(), rq)


def test_quantize_kernel_views_and_batch_dims():
    """A column window of a wider tensor (16-byte aligned rows: no copy; 8-byte: copied), a 3-D
    input, and an empty one."""
    base = testing.randn((40, 200), bf16, DEV, seed=11)
    gs = torch.tensor([100.0], device=DEV)
    for x in (base[:, 16:144], base[:, 4:132], base[3:7, 32:96]):
        q, sf = fp4_quantize(x, gs)
        rq, rsf = fp4_quantize(x.cpu(), gs.cpu())
        assert torch.equal(q.cpu(), rq) and torch.equal(sf.cpu(), rsf)
    x3 = testing.randn((2, 3, 64), torch.float16, DEV, seed=12)
    q, sf = fp4_quantize(x3, None, 32, True)
    rq, rsf = fp4_quantize(x3.cpu(), None, 32, True)
    assert q.shape == (6, 32) and torch.equal(q.cpu(), rq) and torch.equal(sf.cpu(), rsf)
    q, sf = fp4_quantize(torch.empty(0, 64, device=DEV, dtype=bf16))
    assert q.shape == (0, 32) and sf.shape == (0, 4)


def test_repeat_quantize_calls_take_the_fast_path_and_stay_correct():
    """Repeat calls (recorded signature): new data and global scale each call, new outputs; a
    misaligned view with the same signature goes through the checks."""
    fp4_api.reset_dispatch()
    from fi_gemm.fp4 import quant

    gs = torch.tensor([100.0], device=DEV)
    x = testing.randn((5, 256), bf16, DEV, seed=20)
    first = fp4_quantize(x, gs)
    assert len(quant._FAST) == 1, "a checked call on an aligned input must record its signature"
    for seed in (21, 22):
        x2 = testing.randn((5, 256), bf16, DEV, seed=seed)
        gs2 = torch.tensor([float(seed)], device=DEV)
        q, sf = fp4_quantize(x2, gs2)
        assert q.data_ptr() != first[0].data_ptr()
        rq, rsf = fp4_quantize(x2.cpu(), gs2.cpu())
        assert torch.equal(q.cpu(), rq) and torch.equal(sf.cpu(), rsf)
    buf = testing.randn((5 * 256 + 8,), bf16, DEV, seed=23)
    x_odd = buf[4: 4 + 5 * 256].view(5, 256)  # 8 bytes past a 16-byte boundary, same signature
    q, sf = fp4_quantize(x_odd, gs)
    rq, rsf = fp4_quantize(x_odd.cpu(), gs.cpu())
    assert torch.equal(q.cpu(), rq) and torch.equal(sf.cpu(), rsf)
    assert len(quant._FAST) == 1


def test_quantize_cuda_graph_replay():
    x = testing.randn((64, 256), bf16, DEV, seed=13)
    gs = torch.tensor([50.0], device=DEV)
    fp4_quantize(x, gs)  # load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, sf = fp4_quantize(x, gs)
    x.copy_(testing.randn((64, 256), bf16, DEV, seed=14))
    gs.fill_(80.0)
    graph.replay()
    rq, rsf = fp4_quantize(x.cpu(), gs.cpu())
    assert torch.equal(q.cpu(), rq) and torch.equal(sf.cpu(), rsf)


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


# Repeat calls of the decode shapes take the recorded fast path (fp4_api._FAST): new codes,
# scales, alpha and output each call; a misaligned operand, out= or another format goes through
# the checks.
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_8x4", "mxfp4"])
def test_repeat_decode_calls_take_the_fast_path_and_stay_correct(fmt):
    fp4_api.reset_dispatch()
    block, mx, l8 = _FMT[fmt]

    def call(a, sa, b, sb, alpha, **kw):
        return mm_fp4(a, b.T, sa, sb.T, alpha, block_size=block, use_nvfp4=not mx, use_8x4_sf_layout=l8, **kw)

    def ref(a, sa, b, sb, alpha):
        return mm_fp4_reference(a, b, sa, sb, alpha, torch.float32, block, mx, "8x4" if l8 else "128x4")

    ops = _operands(7, 1000, 800, fmt, seed=40)
    first = call(*ops)
    assert len(fp4_api._FAST) == 1, "a checked gemv_fp4 call without copies must record its signature"
    for seed in (41, 42):
        ops2 = _operands(7, 1000, 800, fmt, seed=seed)
        got = call(*ops2)
        assert got.data_ptr() != first.data_ptr(), "every call returns a new output"
        testing.assert_close(got.float() / 30, ref(*ops2) / 30, dtype=bf16)
    # a's codes 8 bytes past a 16-byte boundary: the checks copy them (and record nothing)
    a, sa, b, sb, alpha = ops
    buf = torch.zeros(7 * 400 + 16, dtype=torch.uint8, device=DEV)
    a_odd = buf[8: 8 + 7 * 400].view(7, 400)
    a_odd.copy_(a)
    testing.assert_close(call(a_odd, sa, b, sb, alpha).float() / 30, ref(*ops) / 30, dtype=bf16)
    out = testing.empty_poisoned((7, 1000), bf16, DEV)
    call(*ops, out=out)
    testing.assert_close(out.float() / 30, ref(*ops) / 30, dtype=bf16)
    assert len(fp4_api._FAST) == 1


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

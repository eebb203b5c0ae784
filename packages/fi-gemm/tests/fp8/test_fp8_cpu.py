"""CPU tests of the FP8 helpers and block-scaled GEMM: quantisers against explicit per-element
formulas, the groupwise reference against a naive per-block loop, both scale major modes,
validation, torch.compile tracing."""

import pytest
import torch

from fi_core.errors import InputError, InputTypeError, UnsupportedError
from fi_gemm import (gemm_fp8_nt_groupwise, group_gemm_fp8_nt_groupwise, quantize_fp8_block,
                     quantize_fp8_per_tensor, quantize_fp8_per_token_group)
from fi_gemm.fp8.reference import groupwise_reference

e4m3 = torch.float8_e4m3fn


def test_per_tensor_quant_formula():
    x = torch.tensor([[0.5, -3.0], [2.0, 1.0]])
    q, s = quantize_fp8_per_tensor(x)
    assert s.shape == (1,) and abs(float(s) - 3.0 / 448.0) < 1e-9
    torch.testing.assert_close(q.float(), (x / s).to(e4m3).float())


def test_per_token_group_quant_formula_and_modes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 200, generator=g)
    q, s = quantize_fp8_per_token_group(x, 128)
    assert s.shape == (3, 2)
    for i in range(3):
        for b, (c0, c1) in enumerate([(0, 128), (128, 200)]):
            amax = x[i, c0:c1].abs().max()
            assert torch.isclose(s[i, b], amax / 448.0)
            torch.testing.assert_close(q[i, c0:c1].float(), (x[i, c0:c1] / s[i, b]).to(e4m3).float())
    q2, s2 = quantize_fp8_per_token_group(x, 128, scale_major_mode="MN")
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s.T)


def test_block_quant_formula():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, 260, generator=g)
    q, s = quantize_fp8_block(w)
    assert s.shape == (2, 3)
    blk = w[128:130, 256:260]
    assert torch.isclose(s[1, 2], blk.abs().max() / 448.0)
    torch.testing.assert_close(q[128:130, 256:260].float(), (blk / s[1, 2]).to(e4m3).float())


def test_groupwise_reference_matches_naive_loop():
    g = torch.Generator().manual_seed(2)
    a, sa = quantize_fp8_per_token_group(torch.randn(2, 256, generator=g))
    b, sb = quantize_fp8_block(torch.randn(3, 256, generator=g))
    got = groupwise_reference(a, b, sa, sb, torch.float32)
    naive = torch.zeros(2, 3, dtype=torch.float64)
    for i in range(2):
        for j in range(3):
            for kb in range(2):
                blk = slice(kb * 128, (kb + 1) * 128)
                part = (a[i, blk].double() * b[j, blk].double()).sum()
                naive[i, j] += part * float(sa[i, kb]) * float(sb[j // 128, kb])
    torch.testing.assert_close(got.double(), naive, atol=1e-4, rtol=1e-5)


def test_quantised_gemm_close_to_unquantised():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 512, generator=g), torch.randn(256, 512, generator=g)
    a, sa = quantize_fp8_per_token_group(x, scale_major_mode="MN")
    b, sb = quantize_fp8_block(w, scale_major_mode="MN")
    got = gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="MN", out_dtype=torch.float16)
    rel = ((got.float() - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert rel < 0.05, rel


def test_both_major_modes_agree():
    g = torch.Generator().manual_seed(4)
    a, sa = quantize_fp8_per_token_group(torch.randn(5, 384, generator=g))
    b, sb = quantize_fp8_block(torch.randn(200, 384, generator=g))
    k_mode = gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="K")
    mn_mode = gemm_fp8_nt_groupwise(a, b, sa.T.contiguous(), sb.T.contiguous(), scale_major_mode="MN")
    assert torch.equal(k_mode, mn_mode)


def test_group_gemm_cpu_matches_per_group():
    g = torch.Generator().manual_seed(5)
    a, sa = quantize_fp8_per_token_group(torch.randn(7, 256, generator=g))
    bs = [quantize_fp8_block(torch.randn(64, 256, generator=g)) for _ in range(2)]
    b = torch.stack([q for q, _ in bs])
    sb = torch.stack([s for _, s in bs])
    ip = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = group_gemm_fp8_nt_groupwise(a, b, sa, sb, ip, scale_major_mode="K")
    torch.testing.assert_close(out[:3], groupwise_reference(a[:3], b[0], sa[:3], sb[0], torch.bfloat16))
    torch.testing.assert_close(out[3:], groupwise_reference(a[3:], b[1], sa[3:], sb[1], torch.bfloat16))


@pytest.mark.parametrize("kwargs, exc, text", [
    (dict(scale_granularity_mnk=(1, 128, 64)), UnsupportedError, "scale_granularity_mnk"),
    (dict(scale_major_mode="X"), InputError, "scale_major_mode"),
    (dict(out_dtype=torch.float32), InputTypeError, "out_dtype"),
    (dict(a_scale=torch.ones(2, 2)), InputError, "a_scale must have shape [4, 2]"),
    (dict(b_scale=torch.ones(2, 2, dtype=torch.float64)), InputTypeError, "b_scale must be float32"),
])
def test_groupwise_validation(kwargs, exc, text):
    a = torch.randn(4, 256).to(e4m3)
    b = torch.randn(128, 256).to(e4m3)
    args = dict(a=a, b=b, a_scale=torch.ones(4, 2), b_scale=torch.ones(1, 2), scale_major_mode="K")
    args.update(kwargs)
    with pytest.raises(exc) as info:
        gemm_fp8_nt_groupwise(**args)
    assert text in str(info.value)


def test_torch_compile_fullgraph_cpu():
    a, sa = quantize_fp8_per_token_group(torch.randn(3, 256))
    b, sb = quantize_fp8_block(torch.randn(128, 256))

    def f(a, b, sa, sb):
        return gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="K").float() * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, b, sa, sb), f(a, b, sa, sb), atol=0, rtol=0)


def test_groupwise_backend_reasons():
    from fi_core import Arch
    from fi_gemm.fp8 import groupwise as gw

    h = Arch.parse("9.0a")
    by = {b.name: b for b in gw.GEMM_FP8_GROUPWISE.backends}
    f = dict(m=128, k_ok=True, d_ok=True, segmented=False, arch=h)
    assert by["gemv"].reason("cuda", h, e4m3, f) is not None          # M > 16
    assert by["cutlass_sm90"].reason("cuda", h, e4m3, f) is None
    assert by["cutlass_sm90"].reason("cuda", h, e4m3, dict(f, m=127)) is None  # scales padded
    assert by["cutlass_sm90"].reason("cuda", Arch.parse("8.9"), e4m3, f) is not None
    assert by["gemv"].reason("cuda", h, e4m3, dict(f, m=1)) is None
    # the mma.sync unit: M > 16 on sm_89 (any M) and Hopper's M % 4 != 0, never row segments
    ada = Arch.parse("8.9")
    assert by["mma_sm89"].reason("cuda", ada, e4m3, dict(f, m=127, arch=ada)) is None
    assert by["mma_sm89"].reason("cuda", Arch.parse("8.0"), e4m3, f) is not None
    assert "segments" in by["mma_sm89"].reason("cuda", h, e4m3, dict(f, segmented=True))
    names = [b.name for b in gw.GEMM_FP8_GROUPWISE.backends]
    assert names.index("cutlass_sm90") < names.index("mma_sm89") < names.index("reference")
    assert "mma_sm89" not in gw.GROUP_GEMM_FP8_GROUPWISE.backend_names()
    assert [s.name for s in gw.GEMM_FP8_GROUPWISE.specs(h)] == [
        "gemv_e4m3_e4m3_bf16", "gemm_blockwise_sm89_e4m3_e4m3_bf16",
        "gemm_blockwise_sm90_e4m3_e4m3_bf16_default", "gemm_blockwise_sm90_e4m3_e4m3_bf16_swizzled"]


def test_blockwise_large_config_is_switchable(monkeypatch):
    from fi_core import Arch
    from fi_gemm.fp8 import spec

    # by shape: weights over SWIZZLE_W_BYTES take the swizzled order, M <= 256 always "default"
    assert spec.blockwise_config(8192, 8192, 8192) == "swizzled"
    assert spec.blockwise_config(4096, 4096, 4096) == "default"
    assert spec.blockwise_config(256, 8192, 8192) == "default"
    monkeypatch.setattr(spec, "BLOCKWISE_LARGE", "swizzled")
    assert spec.blockwise_config(4096, 4096, 4096) == "swizzled"
    assert spec.blockwise_config(256, 8192, 8192) == "default"
    # every unit keeps one weight scale block per N tile (the mainloop's static requirement)
    assert all(c.tile_n % 128 == 0 and c.swizzle in (1, 2, 4, 8) for c in spec.BLOCKWISE_CONFIGS.values())
    names = [s.name for s in spec.blockwise_candidate_specs(Arch.parse("9.0a"))]
    assert names == [f"gemm_blockwise_sm90_e4m3_e4m3_bf16_{c}" for c in spec.BLOCKWISE_CONFIGS if c != "default"]

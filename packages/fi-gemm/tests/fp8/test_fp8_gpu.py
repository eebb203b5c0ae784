"""GPU tests of the block-scaled FP8 GEMMs against the fp32 dequantised reference.

Grid reduction: M covers the decode kernel (1, 3, 16), the CUTLASS blockwise kernel (128, 1024:
M % 4 == 0, and 127 with its padded scale copy); K = 784 ends in a partial 128-block; N = 1000 ends
in a partial 128-row weight block. Both scale modes.
"""

import pytest
import torch

from fi_core import arch_of, load_many, testing
from fi_gemm.warm import gpu_test_specs
from fi_gemm import (gemm_fp8_nt_groupwise, group_gemm_fp8_nt_groupwise, quantize_fp8_block,
                     quantize_fp8_per_token_group)
from fi_gemm.fp8 import groupwise
from fi_gemm.fp8 import spec as fp8_spec
from fi_gemm.fp8.reference import groupwise_reference

pytestmark = testing.gpu_only()
DEV = "cuda"
bf16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _needs_sm89():
    if arch_of(torch.device(DEV)).cc < 89:
        pytest.skip("fp8 MMA needs sm_89+")


@pytest.fixture(scope="module", autouse=True)
def _warm():
    load_many(gpu_test_specs(arch_of(torch.device(DEV))))


@pytest.mark.parametrize("m", [1, 3, 16, 127, 128, 1024])
@pytest.mark.parametrize("n, k", [(1000, 784), (256, 4096)])
@pytest.mark.parametrize("mode", ["K", "MN"])
def test_gemm_fp8_nt_groupwise(m, n, k, mode):
    x = testing.randn((m, k), torch.float32, DEV, seed=m)
    w = testing.randn((n, k), torch.float32, DEV, seed=n)
    a, sa = quantize_fp8_per_token_group(x, scale_major_mode=mode)
    b, sb = quantize_fp8_block(w, scale_major_mode=mode)
    out = testing.empty_poisoned((m, n), bf16, DEV)
    gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode=mode, out=out)
    sa_mk = sa if mode == "K" else sa.T
    sb_nk = sb if mode == "K" else sb.T
    ref = groupwise_reference(a, b, sa_mk, sb_nk, torch.float32)
    # outputs are O(sqrt(k)); compare relative to that scale
    testing.assert_close(out.float() / k ** 0.5, ref / k ** 0.5, dtype=bf16)


@pytest.mark.parametrize("m, n, k", [(17, 256, 512), (130, 1000, 1040), (4095, 4096, 4096),
                                     (1024, 384, 7168)])
@pytest.mark.parametrize("mode", ["K", "MN"])
def test_gemm_fp8_nt_groupwise_mma_sm89(m, n, k, mode):
    """The mma.sync unit by name (the M > 16 path of Ada; on Hopper the default for M % 4 != 0):
    partial M, N and K tiles (N = 1000, K = 1040: a last weight block of 104 rows and a last K
    block of 16), both scale modes, a DeepSeek-sized K = 7168."""
    x = testing.randn((m, k), torch.float32, DEV, seed=m + k)
    w = testing.randn((n, k), torch.float32, DEV, seed=n)
    a, sa = quantize_fp8_per_token_group(x, scale_major_mode=mode)
    b, sb = quantize_fp8_block(w, scale_major_mode=mode)
    out = testing.empty_poisoned((m, n), bf16, DEV)
    groupwise.reset_dispatch()
    gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode=mode, out=out, backend="mma_sm89")
    assert set(groupwise._CHOICE.values()) == {"mma_sm89"}
    ref = groupwise_reference(a, b, sa if mode == "K" else sa.T, sb if mode == "K" else sb.T, torch.float32)
    testing.assert_close(out.float() / k ** 0.5, ref / k ** 0.5, dtype=bf16)


def test_gemm_fp8_nt_groupwise_mma_sm89_e5m2_fp16_out():
    m, n, k = 200, 512, 640
    x = testing.randn((m, k), torch.float32, DEV, seed=3)
    w = testing.randn((n, k), torch.float32, DEV, seed=4)
    a, sa = quantize_fp8_per_token_group(x, scale_major_mode="K")
    b, sb = quantize_fp8_block(w, scale_major_mode="K")
    a = (a.float() * 0.5).to(torch.float8_e5m2)  # the same values up to e5m2 rounding, halved
    out = testing.empty_poisoned((m, n), torch.float16, DEV)
    gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="K", out=out, out_dtype=torch.float16,
                          backend="mma_sm89")
    ref = groupwise_reference(a, b, sa, sb, torch.float32)
    testing.assert_close(out.float() / k ** 0.5, ref / k ** 0.5, dtype=torch.float16)


@pytest.mark.parametrize("m", [127, 4093])
@pytest.mark.parametrize("mode", ["K", "MN"])
def test_gemm_fp8_nt_groupwise_m_not_a_multiple_of_4(m, mode):
    """The Hopper TMA unit loads a_scale with TMA (16-byte rows of [kb, M]): for M % 4 != 0 it
    gets a padded copy (until session 14 these calls ran the fp32 reference). Off Hopper the
    mma.sync unit takes every M > 16."""
    groupwise.reset_dispatch()
    n, k = 384, 1152
    a, sa = quantize_fp8_per_token_group(testing.randn((m, k), torch.float32, DEV, seed=5), scale_major_mode=mode)
    b, sb = quantize_fp8_block(testing.randn((n, k), torch.float32, DEV, seed=6), scale_major_mode=mode)
    out = testing.empty_poisoned((m, n), bf16, DEV)
    gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode=mode, out=out)
    hopper = arch_of(torch.device(DEV)).cc == 90
    assert set(groupwise._CHOICE.values()) == {"cutlass_sm90" if hopper else "mma_sm89"}
    ref = groupwise_reference(a, b, sa if mode == "K" else sa.T, sb if mode == "K" else sb.T, torch.float32)
    testing.assert_close(out.float() / k ** 0.5, ref / k ** 0.5, dtype=bf16)


@pytest.mark.parametrize("lens", [[1, 0, 17, 16], [40, 3]])
def test_group_gemm_fp8_nt_groupwise(lens):
    total, n, k, G = sum(lens), 384, 512, len(lens)
    a, sa = quantize_fp8_per_token_group(testing.randn((total, k), torch.float32, DEV, seed=1),
                                         scale_major_mode="MN")
    qs = [quantize_fp8_block(testing.randn((n, k), torch.float32, DEV, seed=10 + g),
                             scale_major_mode="MN") for g in range(G)]
    b = torch.stack([q for q, _ in qs])
    sb = torch.stack([s for _, s in qs])
    ip = torch.tensor([sum(lens[:i]) for i in range(G + 1)], dtype=torch.int32, device=DEV)
    out = testing.empty_poisoned((total, n), bf16, DEV)
    group_gemm_fp8_nt_groupwise(a, b, sa, sb, ip, out=out)
    for g in range(G):
        r0, r1 = sum(lens[:g]), sum(lens[:g + 1])
        if r1 > r0:
            ref = groupwise_reference(a[r0:r1], b[g], sa.T[r0:r1], sb[g].T, torch.float32)
            testing.assert_close(out[r0:r1].float() / k ** 0.5, ref / k ** 0.5, dtype=bf16)


# A/B candidates of the CUTLASS blockwise unit for M > 256 (BLOCKWISE_CONFIGS beyond "default"),
# switched in through spec.BLOCKWISE_LARGE as the benchmark's blockwise_large option does. M = 320
# is 3 M tiles, the last half full (a 2x1 cluster with an empty CTA); N = 1088 is 9 N tiles, the
# last half full (an empty CTA in a 1x2 cluster) and a partial 128-row weight scale block;
# K = 1152 is 9 scale blocks. 1152 x 1920 is 135 tiles of 16 K blocks: one whole wave on the
# H200's 132 SMs and three tiles over (the persistent scheduler's second round).
BLOCKWISE_CANDIDATES = [c for c in fp8_spec.BLOCKWISE_CONFIGS if c != "default"]


@pytest.fixture(scope="module")
def _blockwise_candidates():
    arch = testing.require_cc(90, "the CUTLASS units need sm_90a", DEV)
    load_many(fp8_spec.blockwise_candidate_specs(arch))


@pytest.mark.parametrize("m,n,k", [(320, 1088, 1152), (1152, 1920, 2048)])
@pytest.mark.parametrize("config", BLOCKWISE_CANDIDATES)
def test_gemm_fp8_nt_groupwise_large_candidates(config, m, n, k, monkeypatch, _blockwise_candidates):
    monkeypatch.setattr(fp8_spec, "BLOCKWISE_LARGE", config)
    loaded = []  # the units the dispatch asked for: proof that the candidate ran
    real_load = groupwise.load
    monkeypatch.setattr(groupwise, "load", lambda spec: loaded.append(spec.name) or real_load(spec))
    a, sa = quantize_fp8_per_token_group(testing.randn((m, k), torch.float32, DEV, seed=90),
                                         scale_major_mode="MN")
    b, sb = quantize_fp8_block(testing.randn((n, k), torch.float32, DEV, seed=91),
                               scale_major_mode="MN")
    out = testing.empty_poisoned((m, n), bf16, DEV)
    gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="MN", out=out)
    ref = groupwise_reference(a, b, sa.T, sb.T, torch.float32)
    testing.assert_close(out.float() / k ** 0.5, ref / k ** 0.5, dtype=bf16)
    assert loaded == [f"gemm_blockwise_sm90_e4m3_e4m3_bf16_{config}"], loaded


# Repeat calls take the recorded fast path (groupwise._FAST); new data and scales must give the
# checked path's results, and a call with copies (K-major scales on the CUTLASS path) is never
# recorded.
@pytest.mark.parametrize("m", [16, 128])
def test_repeat_groupwise_calls_take_the_fast_path_and_stay_correct(m):
    if m > 16:
        testing.require_cc(90, "the CUTLASS unit needs sm_90a", DEV)
    groupwise.reset_dispatch()
    n, k = 1000, 784

    def operands(seed, mode):
        a, sa = quantize_fp8_per_token_group(testing.randn((m, k), torch.float32, DEV, seed=seed),
                                             scale_major_mode=mode)
        b, sb = quantize_fp8_block(testing.randn((n, k), torch.float32, DEV, seed=seed + 1),
                                   scale_major_mode=mode)
        return a, b, sa, sb

    gemm_fp8_nt_groupwise(*operands(100, "MN"), scale_major_mode="MN")
    assert len(groupwise._FAST) == 1, "a checked call without copies must record its signature"
    for seed in (102, 104):
        a, b, sa, sb = operands(seed, "MN")
        got = gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="MN")
        ref = groupwise_reference(a, b, sa.T, sb.T, torch.float32)
        testing.assert_close(got.float() / k ** 0.5, ref / k ** 0.5, dtype=bf16)
    a, b, sa, sb = operands(106, "K")
    got = gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="K")
    testing.assert_close(got.float() / k ** 0.5, groupwise_reference(a, b, sa, sb, torch.float32) / k ** 0.5,
                         dtype=bf16)
    assert len(groupwise._FAST) == (2 if m <= 16 else 1), "K-major scales are copied for CUTLASS"

"""Tests of the Hopper fa3 prefill runner (fi_attention.prefill.hopper).

CPU: support matrix and input validation (everything raised before a launch).
GPU (sm_90a only): run_ragged vs attention_reference (fp32) with FA3's tolerance: the kernel's
max error <= 2x the max error of the same math done by torch at the kernel's precision, plus the
output dtype's rounding at |out| ~ 1. Outputs are NaN-poisoned so unwritten rows fail.

Grid reduction: d=128 carries the full matrix (lengths 1/7/127/1000/4097, causal and not, GQA 4,
LSE on); fp16, MHA, d=64/256, strided inputs and batches get one or two cases each.
"""

from __future__ import annotations

import pytest
import torch

from fi_core import knobs
from fi_core import testing
from fi_core.errors import InputError, InputTypeError, UnsupportedError
from fi_attention.prefill import hopper
from fi_attention.prefill.hopper import run_ragged, supports
from fi_attention.reference import attention_reference

BF16, FP16 = torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---------------------------------------------------------------------------- CPU: support matrix
def _facts(**kw):
    base = dict(head_dim_qk=128, head_dim_vo=128, dtype=BF16, kv_dtype=BF16, causal=True,
                custom_mask=False, window_left=-1, logits_soft_cap=None, pos_encoding_mode="NONE",
                paged=False, page_size=1)
    base.update(kw)
    return base


def test_supports_main_case():
    assert supports(**_facts()) is None
    assert supports(**_facts(dtype=FP16, kv_dtype=FP16, causal=False, head_dim_qk=64, head_dim_vo=64)) is None


def test_supports_fp8_kv():
    """fp8 e4m3 / e5m2 K/V at head_dim 64 and 128, paged or ragged; their modules never multicast."""
    from fi_attention.prefill.hopper.spec import prefill_sm90_spec
    for kv in (E4M3, E5M2):
        for d in (64, 128):
            assert supports(**_facts(kv_dtype=kv, head_dim_qk=d, head_dim_vo=d)) is None
            assert supports(**_facts(kv_dtype=kv, head_dim_qk=d, head_dim_vo=d, paged=True, page_size=16)) is None
    spec = prefill_sm90_spec(BF16, 128, True, "9.0a", paged=True, kv_dtype=E5M2)
    assert spec.name.endswith("_kve5m2") and dict(spec.defines)["FI_KV_FP8"] == "2"
    assert "FI_KV_FP8" not in dict(prefill_sm90_spec(BF16, 128, True, "9.0a", kv_dtype=BF16).defines)
    with pytest.raises(ValueError, match="fp8"):
        prefill_sm90_spec(BF16, 128, True, "9.0a", kv_dtype=E4M3, multicast=True)
    with pytest.raises(ValueError, match="fp8"):
        prefill_sm90_spec(BF16, 256, True, "9.0a", kv_dtype=E4M3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [-1, 0, 5, 100])
def test_visible_pairs_counts_the_mask(causal, window):
    """visible_pairs against counting the (bottom-right causal, window) mask row by row; the batched
    form sums the same numbers. The window caps the total at window + 1 keys per row (an upper
    bound: only the module choice reads it)."""
    from fi_attention.prefill.hopper.spec import batch_visible_pairs, visible_pairs
    lens = [(1, 1), (7, 127), (127, 7), (300, 300), (0, 5), (5, 0), (1000, 4097), (64, 64)]
    for qo, kv in lens:
        rows = [max(0, min(kv, i + kv - qo + 1)) if causal else kv for i in range(qo)]
        exact = sum(rows)
        got = visible_pairs(qo, kv, causal, window)
        if window < 0:
            assert got == exact, (qo, kv)
        else:
            assert got == min(exact, qo * (window + 1)), (qo, kv)
            assert got >= sum(min(r, window + 1) for r in rows)
    qo_t, kv_t = torch.tensor([q for q, _ in lens]), torch.tensor([k for _, k in lens])
    assert batch_visible_pairs(qo_t, kv_t, causal, window) == sum(visible_pairs(q, k, causal, window)
                                                                 for q, k in lens)


def test_multicast_threshold_between_bench_shapes():
    """auto: single causal prefill 32/8 heads at L = 16384 takes multicast, 8192 and the paged
    16 x 2048 batch do not (the bench shapes the threshold was set between)."""
    from fi_attention.prefill.hopper.spec import MULTICAST_MIN_FLOPS, visible_pairs
    flops = lambda n, L: 4 * 128 * 32 * n * visible_pairs(L, L, True)  # noqa: E731
    assert flops(1, 16384) >= MULTICAST_MIN_FLOPS > max(flops(1, 8192), flops(16, 2048))


@pytest.mark.parametrize("kw, word", [
    (dict(head_dim_qk=192, head_dim_vo=128), "head_dim"),
    (dict(head_dim_qk=96, head_dim_vo=96), "head_dim"),
    (dict(dtype=torch.float32, kv_dtype=torch.float32), "dtype"),
    (dict(kv_dtype=FP16), "k/v dtype"),
    (dict(kv_dtype=torch.float32), "k/v dtype"),
    (dict(kv_dtype=E4M3, head_dim_qk=256, head_dim_vo=256), "fp8 k/v at head_dim"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), "pos_encoding_mode"),
    (dict(paged=True, page_size=4), "page_size"),
])
def test_supports_gives_reason(kw, word):
    why = supports(**_facts(**kw))
    assert why is not None and word in why


def test_multicast_module_choice():
    """K/V multicast (its own module) for head_dim 128 and an even GQA group: FI_FA3_MULTICAST=1
    always, 0 never, auto (the default) for launches of at least MULTICAST_MIN_FLOPS."""
    from fi_attention.prefill.hopper.spec import MULTICAST_MIN_FLOPS, prefill_sm90_spec, use_multicast
    big, small = MULTICAST_MIN_FLOPS, MULTICAST_MIN_FLOPS * 0.99
    with knobs.override(FI_FA3_MULTICAST=None):  # auto by default
        assert use_multicast(128, 32, 8, big) and not use_multicast(128, 32, 8, small)
        assert not use_multicast(128, 32, 8) and not use_multicast(128, 6, 2, big)
        assert not use_multicast(64, 32, 8, big) and not use_multicast(256, 32, 8, big)
    with knobs.override(FI_FA3_MULTICAST="auto"):
        assert use_multicast(128, 32, 8, 2 * big) and not use_multicast(128, 32, 8, 0.0)
    with knobs.override(FI_FA3_MULTICAST="0"):
        assert not use_multicast(128, 32, 8, 100 * big)
    with knobs.override(FI_FA3_MULTICAST="1"):
        assert use_multicast(128, 32, 8) and use_multicast(128, 8, 1) and use_multicast(128, 4, 2, small)
        assert not use_multicast(128, 6, 2) and not use_multicast(128, 4, 4) and not use_multicast(64, 32, 8)
        assert not use_multicast(256, 32, 8)
    with knobs.override(FI_FA3_MULTICAST="sometimes"):
        with pytest.raises(ValueError, match="FI_FA3_MULTICAST must be one of auto/1/0"):
            use_multicast(128, 32, 8, big)
    spec = prefill_sm90_spec(BF16, 128, True, "9.0a", paged=True, multicast=True)
    assert spec.name.endswith("_mc") and ("FI_FA3_MCAST", "1") in tuple(spec.defines)
    assert "FI_FA3_MCAST" not in dict(prefill_sm90_spec(BF16, 128, True, "9.0a").defines)
    with pytest.raises(ValueError, match="head_dim 128"):
        prefill_sm90_spec(BF16, 64, True, "9.0a", multicast=True)


def test_unsupported_reason_reads_facts_dict():
    assert hopper.unsupported_reason({"head_dim_qk": 128, "dtype": BF16}) is None
    assert hopper.unsupported_reason({"head_dim_qk": 128, "dtype": BF16, "window_left": 8}) is None
    assert hopper.unsupported_reason({"head_dim_qk": 128, "dtype": BF16, "logits_soft_cap": 5.0}) is None
    assert "page_size" in hopper.unsupported_reason({"head_dim_qk": 128, "dtype": BF16, "paged": True,
                                                     "page_size": 1})


# ---------------------------------------------------------------------------- CPU: validation
def _cpu_inputs(dtype=BF16, lq=8, lkv=8, hq=4, hkv=2, d=128):
    q = torch.randn(lq, hq, d).to(dtype)
    k = torch.randn(lkv, hkv, d).to(dtype)
    v = torch.randn(lkv, hkv, d).to(dtype)
    return q, k, v, torch.empty_like(q)


def _call(q, k, v, out, lse=None, **kw):
    args = dict(causal=True, sm_scale=0.1, max_qo_len=q.shape[0], batch_size=1)
    args.update(kw)
    run_ragged(q, k, v, None, None, out, lse, **args)


def test_rejects_float32():
    q, k, v, out = _cpu_inputs(torch.float32)
    with pytest.raises(InputTypeError, match="bfloat16 or float16"):
        _call(q, k, v, out)


def test_rejects_mixed_dtypes():
    q, k, v, out = _cpu_inputs()
    with pytest.raises(InputTypeError, match="k must be torch.bfloat16"):
        _call(q, k.half(), v, out)


def test_rejects_misaligned_strides():
    q, k, v, out = _cpu_inputs()
    big = torch.randn(8, 4, 132).to(BF16)  # token stride 528, head stride 132: not multiples of 8
    with pytest.raises(InputError, match="multiples of 8"):
        _call(big[:, :, :128], k, v, out)


def test_rejects_gqa_mismatch():
    q, k, v, out = _cpu_inputs(hq=6, hkv=4)
    with pytest.raises(InputError, match="multiple of num_kv_heads"):
        _call(q, k, v, out)


def test_rejects_bad_lse():
    q, k, v, out = _cpu_inputs()
    with pytest.raises(InputError, match="lse must be contiguous float32"):
        _call(q, k, v, out, lse=torch.empty(8, 4, dtype=torch.float16))


def test_rejects_one_indptr():
    q, k, v, out = _cpu_inputs()
    with pytest.raises(InputError, match="both"):
        run_ragged(q, k, v, torch.tensor([0, 8], dtype=torch.int32), None, out, None, causal=True,
                   sm_scale=0.1, max_qo_len=8, batch_size=1)


def test_custom_mask_modules_and_checks():
    """Custom masks: their own module (never causal: a mask replaces causality), and the runner
    refuses a mask with causal=True or of the wrong dtype before any launch."""
    from fi_core import Arch
    from fi_attention.prefill.hopper.spec import prefill_sm90_spec
    assert supports(**_facts(custom_mask=True, causal=False)) is None
    s = prefill_sm90_spec(BF16, 128, False, Arch.parse("9.0a"), custom_mask=True)
    assert "_mask" in s.name and dict(s.defines)["FI_CUSTOM_MASK"] == "1"
    assert "FI_CUSTOM_MASK" not in dict(prefill_sm90_spec(BF16, 128, False, Arch.parse("9.0a")).defines)
    with pytest.raises(ValueError, match="replaces the causal"):
        prefill_sm90_spec(BF16, 128, True, Arch.parse("9.0a"), custom_mask=True)
    q, k, v, out = _cpu_inputs()
    packed = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(InputError, match="replaces the causal"):
        run_ragged(q, k, v, None, None, out, None, causal=True, sm_scale=0.1, max_qo_len=8, batch_size=1,
                   packed_mask=packed)
    with pytest.raises(InputError, match="packed_mask must be contiguous 1-D uint8"):
        run_ragged(q, k, v, None, None, out, None, causal=False, sm_scale=0.1, max_qo_len=8, batch_size=1,
                   packed_mask=packed.to(torch.int32))
    i32 = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(InputError, match="mask_indptr must be int32"):
        run_ragged(q, k, v, i32, i32, out, None, causal=False, sm_scale=0.1, max_qo_len=8, batch_size=1,
                   packed_mask=packed)


def test_rejects_fp8_kv_at_head_dim_256_and_misaligned_fp8_strides():
    q, k, v, out = _cpu_inputs(d=256)
    with pytest.raises(UnsupportedError, match="fp8 k/v at head_dim"):
        _call(q, k.to(E4M3), v.to(E4M3), out)
    q, k, v, out = _cpu_inputs()
    with pytest.raises(InputTypeError, match="v must be"):
        _call(q, k.to(E4M3), v.to(E5M2), out)
    wide = torch.randn(8, 2, 136).to(E4M3)[:, :, :128]  # head stride 136: 8-aligned, not 16
    with pytest.raises(InputError, match="multiples of 16 elements"):
        _call(q, wide, wide, out)


def test_rejects_small_page_size():
    q, k, v, out = _cpu_inputs()
    kc = torch.randn(4, 4, 2, 128).to(BF16)
    i32 = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="page_size"):
        hopper.run_paged(q, kc, kc, i32, i32, i32, i32, out, None, k_strides=(1024, 256, 128),
                         v_strides=(1024, 256, 128), page_size=4, causal=True, sm_scale=0.1,
                         max_qo_len=8, batch_size=1)


# ---------------------------------------------------------------------------- GPU
def _torch_same_precision(q, k, v, causal, sm_scale, window_left=-1, softcap=0.0):
    """Attention by torch at the inputs' precision (S and P rounded to q.dtype, as the kernel's
    P is), on the GPU: the yardstick of the FA3 tolerance."""
    lq, hq, _ = q.shape
    lkv, hkv, _ = k.shape
    g = hq // hkv
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk).float() * sm_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(lq, device=q.device)[:, None] + (lkv - lq)
    kpos = torch.arange(lkv, device=q.device)[None, :]
    keep = torch.ones(lq, lkv, dtype=torch.bool, device=q.device)
    if causal:
        keep &= kpos <= qpos
    if window_left >= 0:
        keep &= kpos >= qpos - window_left
    s = s.masked_fill(~keep[None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p.to(q.dtype), vv)


def _check(qo_lens, kv_lens, *, causal, dtype=BF16, hq=8, hkv=2, d=128, with_lse=True, seed=0,
           strided=False, window_left=-1, page_size=0, layout="NHD", softcap=0.0, kv_dtype=None):
    dev = "cuda"
    nq, nkv = sum(qo_lens), sum(kv_lens)
    if strided == "hnd":  # head-major views ([H, L, D] storage seen as [L, H, D])
        q = testing.randn((hq, nq, d), dtype, dev, seed=seed).transpose(0, 1)
        k = testing.randn((hkv, nkv, d), dtype, dev, seed=seed + 1).transpose(0, 1)
        v = testing.randn((hkv, nkv, d), dtype, dev, seed=seed + 2).transpose(0, 1)
    elif strided:  # q/k/v as column slices of wider buffers (token/head strides != dense)
        q = testing.randn((nq, hq, d + 64), dtype, dev, seed=seed)[:, :, :d]
        kv = testing.randn((nkv, hkv, 2, d), dtype, dev, seed=seed + 1)
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:
        q = testing.randn((nq, hq, d), dtype, dev, seed=seed)
        k = testing.randn((nkv, hkv, d), dtype, dev, seed=seed + 1)
        v = testing.randn((nkv, hkv, d), dtype, dev, seed=seed + 2)
    if kv_dtype is not None and kv_dtype != dtype:  # fp8 K/V: the references read the fp8 values
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = testing.empty_poisoned((nq, hq, d), dtype, dev)
    lse = testing.empty_poisoned((nq, hq), torch.float32, dev) if with_lse else None
    scale = d ** -0.5
    qo_ind = [0]
    kv_ind = [0]
    for a, b in zip(qo_lens, kv_lens):
        qo_ind.append(qo_ind[-1] + a)
        kv_ind.append(kv_ind[-1] + b)
    single = len(qo_lens) == 1 and not page_size
    if page_size:
        _run_paged_from_ragged(q, k, v, qo_ind, kv_ind, out, lse, page_size, layout, causal=causal,
                               sm_scale=scale, window_left=window_left, seed=seed, softcap=softcap)
    else:
        run_ragged(q, k, v,
                   None if single else torch.tensor(qo_ind, dtype=torch.int32, device=dev),
                   None if single else torch.tensor(kv_ind, dtype=torch.int32, device=dev),
                   out, lse, causal=causal, sm_scale=scale, window_left=window_left,
                   logits_soft_cap=softcap or None, max_qo_len=max(qo_lens), batch_size=len(qo_lens))
    torch.cuda.synchronize()
    exact, lowp, ref_lse = [], [], []
    for i in range(len(qo_lens)):
        qs, ks = slice(qo_ind[i], qo_ind[i + 1]), slice(kv_ind[i], kv_ind[i + 1])
        o32, l32 = attention_reference(q[qs].float(), k[ks].float(), v[ks].float(), causal=causal,
                                       sm_scale=scale, window_left=window_left,
                                       logits_soft_cap=softcap or None, return_lse=True)
        exact.append(o32.cpu())
        ref_lse.append(l32.cpu())
        lowp.append(_torch_same_precision(q[qs], k[ks].to(dtype), v[ks].to(dtype), causal, scale, window_left,
                                          softcap).cpu())
    exact, lowp, ref_lse = torch.cat(exact), torch.cat(lowp), torch.cat(ref_lse)
    rounded = exact.to(dtype)
    atol = 2 * (rounded + 0.3 - 0.3 - rounded).abs().max().item()  # dtype rounding near |out|
    tag = (f"qo={qo_lens} kv={kv_lens} causal={causal} window={window_left} cap={softcap} {dtype} kv {k.dtype} "
           f"d={d} hq/hkv={hq}/{hkv}: ")
    testing.assert_close_to_reference_run(out, lowp, exact, factor=2.0, atol=atol, msg=tag)
    if with_lse:
        testing.assert_close(lse, ref_lse, dtype=torch.float32, atol=2e-3, rtol=1e-3, msg=tag + "lse: ")
    return out, lse


def _run_paged_from_ragged(q, k, v, qo_ind, kv_ind, out, lse, page_size, layout, *, causal, sm_scale,
                           window_left, seed, softcap=0.0):
    """Scatters ragged k/v into a shuffled paged cache ([P, 2, page, H, D] NHD or [P, 2, H, page, D]
    HND, 3 spare pages) and runs run_paged on it."""
    dev = q.device
    hkv, d = k.shape[1], k.shape[2]
    batch = len(qo_ind) - 1
    pages_per = [-(-(kv_ind[i + 1] - kv_ind[i]) // page_size) for i in range(batch)]
    total = sum(pages_per) + 3
    perm = torch.randperm(total, generator=testing.generator(seed))[:sum(pages_per)]
    shape = (total, 2, hkv, page_size, d) if layout == "HND" else (total, 2, page_size, hkv, d)
    cache = testing.randn(shape, q.dtype, dev, seed=seed + 99).to(k.dtype)  # spare/tail slots: junk, not 0
    if layout == "NHD_pad":
        # pages 64 elements apart beyond their size: a page stride that is no multiple of the head
        # stride (nor of the token stride)
        ps = 2 * page_size * hkv * d + 64
        flat = torch.empty(total * ps, dtype=k.dtype, device=dev)
        padded = flat.as_strided(shape, (ps, page_size * hkv * d, hkv * d, d, 1))
        padded.copy_(cache)
        cache = padded
    kv_indptr, indices, last = [0], [], []
    p = 0
    for i in range(batch):
        n = kv_ind[i + 1] - kv_ind[i]
        for j in range(pages_per[i]):
            page = int(perm[p])
            p += 1
            indices.append(page)
            lo, hi = kv_ind[i] + j * page_size, min(kv_ind[i] + (j + 1) * page_size, kv_ind[i + 1])
            if layout != "HND":
                cache[page, 0, :hi - lo] = k[lo:hi]
                cache[page, 1, :hi - lo] = v[lo:hi]
            else:
                cache[page, 0, :, :hi - lo] = k[lo:hi].transpose(0, 1)
                cache[page, 1, :, :hi - lo] = v[lo:hi].transpose(0, 1)
        kv_indptr.append(len(indices))
        last.append(n - (pages_per[i] - 1) * page_size if n else 0)
    kc, vc = cache[:, 0], cache[:, 1]
    if layout != "HND":
        ks, vs = (kc.stride(0), kc.stride(1), kc.stride(2)), (vc.stride(0), vc.stride(1), vc.stride(2))
    else:
        ks, vs = (kc.stride(0), kc.stride(2), kc.stride(1)), (vc.stride(0), vc.stride(2), vc.stride(1))
    i32 = dict(dtype=torch.int32, device=dev)
    qo_lens = [qo_ind[i + 1] - qo_ind[i] for i in range(batch)]
    hopper.run_paged(q, kc, vc, torch.tensor(qo_ind, **i32), torch.tensor(kv_indptr, **i32),
                     torch.tensor(indices or [0], **i32), torch.tensor(last, **i32), out, lse,
                     k_strides=ks, v_strides=vs, page_size=page_size, causal=causal, sm_scale=sm_scale,
                     window_left=window_left, logits_soft_cap=softcap or None,
                     max_qo_len=max(qo_lens), batch_size=batch,
                     num_kv_heads=hkv)


gpu = testing.gpu_only()


def _test_specs(a):
    """Every module these tests load (also read by tools/prebuild_prefill_tests.py)."""
    from fi_attention.prefill.hopper.spec import prefill_sm90_spec
    specs = [prefill_sm90_spec(dt, d, c, a) for dt in (BF16, FP16) for d in (128,) for c in (True, False)]
    specs += [prefill_sm90_spec(BF16, d, c, a) for d in (64, 256) for c in (True, False)]
    specs += [prefill_sm90_spec(BF16, 128, c, a, paged=True) for c in (True, False)]
    specs += [prefill_sm90_spec(BF16, 128, c, a, softcap=True) for c in (True, False)]
    # GQA cases at head_dim 128 (even groups) run the K/V multicast modules
    specs += [prefill_sm90_spec(dt, 128, c, a, multicast=True) for dt in (BF16, FP16) for c in (True, False)]
    specs += [prefill_sm90_spec(BF16, 128, c, a, paged=True, multicast=True) for c in (True, False)]
    specs += [prefill_sm90_spec(BF16, 128, c, a, softcap=True, multicast=True) for c in (True, False)]
    # fp8 K/V (test_fp8_kv_*)
    specs += [prefill_sm90_spec(BF16, 128, c, a, paged=p, kv_dtype=kv) for c in (True, False) for p in (False, True)
              for kv in (E4M3, E5M2)]
    specs += [prefill_sm90_spec(dt, 64, c, a, paged=p, kv_dtype=E4M3) for dt in (BF16, FP16) for c in (True, False)
              for p in (False, True)]
    specs += [prefill_sm90_spec(FP16, 128, c, a, kv_dtype=E5M2) for c in (True, False)]
    specs += [prefill_sm90_spec(BF16, 128, c, a, softcap=True, kv_dtype=E4M3) for c in (True, False)]
    return specs


@pytest.fixture(scope="module", autouse=True)
def _prebuild_variants():
    """Compiles every module these tests load in one parallel ninja run instead of one by one on
    first use."""
    if not testing.has_cuda() or torch.cuda.get_device_capability() != (9, 0):
        return
    from fi_core import arch_of, build_many
    build_many(_test_specs(arch_of(torch.device("cuda"))))


def _needs_sm90():
    if not testing.has_cuda() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs an sm_90 GPU")


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L", [1, 7, 127, 1000, 4097])
def test_single_bf16_d128(L, causal):
    _needs_sm90()
    _check([L], [L], causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lq, lkv", [(100, 1000), (129, 4097), (1, 300), (300, 200)])
def test_qo_shorter_or_longer_than_kv(lq, lkv, causal):
    # (300, 200) causal: the first 100 queries see no key -> out 0, lse -inf.
    _needs_sm90()
    _check([lq], [lkv], causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_batch_ragged(causal):
    _needs_sm90()
    _check([1, 7, 127, 300, 1000, 129], [1, 100, 127, 400, 1000, 700], causal=causal, seed=5)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_fp16(causal):
    _needs_sm90()
    _check([1000], [1000], causal=causal, dtype=FP16, seed=7)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
def test_mha_no_lse_strided():
    _needs_sm90()
    _check([777], [777], causal=True, hq=4, hkv=4, with_lse=False, strided=True, seed=9)
    _check([3, 500], [300, 500], causal=False, hq=8, hkv=1, strided=True, seed=11)
    _check([1000], [1000], causal=True, strided="hnd", seed=12)
    _check([129, 77], [1000, 77], causal=False, strided="hnd", seed=14)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_other_head_dims(d, causal):
    _needs_sm90()
    _check([1000], [1000], causal=causal, d=d, seed=13)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
def test_deterministic():
    _needs_sm90()
    a, la = _check([1000, 333], [1200, 333], causal=True, seed=17)
    b, lb = _check([1000, 333], [1200, 333], causal=True, seed=17)
    assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lq, lkv, window", [(1000, 1000, 0), (1000, 1000, 200), (300, 2000, 700), (2000, 2000, 127)])
def test_sliding_window(lq, lkv, window, causal):
    _needs_sm90()
    _check([lq], [lkv], causal=causal, window_left=window, seed=19)
    _check([lq, 50], [lkv, 300], causal=causal, window_left=window, seed=23)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size, layout", [(16, "NHD"), (8, "HND"), (64, "NHD"), (256, "NHD"), (128, "HND"),
                                               (16, "NHD_pad"), (256, "NHD_pad")])
def test_paged(page_size, layout, causal):
    _needs_sm90()
    _check([1, 7, 300, 129, 1000], [1, 100, 300, 777, 1000], causal=causal, page_size=page_size,
           layout=layout, seed=29)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d, page_size, layout", [(64, 16, "NHD"), (64, 128, "HND"), (256, 16, "NHD"),
                                                  (256, 80, "HND")])
def test_paged_other_head_dims(d, page_size, layout):
    _needs_sm90()
    _check([7, 300, 1000], [100, 777, 1000], causal=True, d=d, page_size=page_size, layout=layout, seed=41)


# ---------------------------------------------------------------------------- GPU: fp8 K/V
# fp8 e4m3 / e5m2 K/V widened to the q dtype in shared memory by the producer warpgroup (FI_KV_FP8):
# against the fp32 reference on the fp8 values, ragged and paged, both page regimes (pages inside a
# KV tile: boxes spread over 4 producer warps; pages of a tile or more: warp 0 alone issues).
@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_kv_ragged(kv_dtype, causal):
    _needs_sm90()
    _check([1, 7, 127, 300, 1000, 129], [1, 100, 127, 400, 1000, 700], causal=causal, kv_dtype=kv_dtype, seed=51)
    _check([4097], [4097], causal=causal, kv_dtype=kv_dtype, seed=52)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size, layout, kv_dtype", [(16, "NHD", E4M3), (8, "HND", E4M3), (128, "NHD", E5M2),
                                                         (256, "HND", E4M3), (16, "NHD_pad", E5M2)])
def test_fp8_kv_paged(page_size, layout, kv_dtype, causal):
    _needs_sm90()
    _check([1, 7, 300, 129, 1000], [1, 100, 300, 777, 1000], causal=causal, page_size=page_size, layout=layout,
           kv_dtype=kv_dtype, seed=53)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [
    dict(qo_lens=[1000, 77], kv_lens=[1000, 300], causal=True, d=64),
    dict(qo_lens=[1000, 77], kv_lens=[1000, 300], causal=False, d=64, dtype=FP16, page_size=16),
    dict(qo_lens=[300, 1], kv_lens=[2000, 1], causal=True, d=64, dtype=FP16),
    dict(qo_lens=[1000], kv_lens=[1000], causal=True, dtype=FP16, kv_dtype=E5M2),
    dict(qo_lens=[2000, 50], kv_lens=[2000, 300], causal=True, window_left=127),
    dict(qo_lens=[1000, 77], kv_lens=[1000, 300], causal=False, softcap=2.0),
    dict(qo_lens=[777], kv_lens=[777], causal=True, hq=4, hkv=4, with_lse=False, strided=True),
    dict(qo_lens=[129, 77], kv_lens=[1000, 77], causal=False, strided="hnd"),
    dict(qo_lens=[300, 200], kv_lens=[200, 4000], causal=True, hq=8, hkv=1),
])
def test_fp8_kv_features(case):
    _needs_sm90()
    _check(**{"kv_dtype": E4M3, **case}, seed=55)


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, d, kv_dtype", [(BF16, 128, E4M3), (BF16, 128, E5M2), (FP16, 128, E5M2),
                                                (BF16, 64, E4M3), (FP16, 64, E4M3)])
def test_fp8_kv_widening_is_exact(dtype, d, kv_dtype):
    """One key per request: the output is that key's V row, so it must equal torch's widening of
    every finite fp8 byte bit for bit (both dtypes and both widening paths: d = 64 and 128)."""
    _needs_sm90()
    hq, hkv, n = 4, 2, 4
    codes = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(codes.view(kv_dtype).float())
    codes = torch.where(finite, codes, torch.zeros_like(codes))  # NaN / Inf: a corrupt cache, not widened exactly
    g = testing.generator(61)
    rows = torch.stack([codes[torch.randperm(256, generator=g)] for _ in range(n * hkv * d // 256)])
    v = rows.reshape(n, hkv, d).view(kv_dtype).cuda()
    k = testing.randn((n, hkv, d), dtype, "cuda", seed=62).to(kv_dtype)
    q = testing.randn((n, hq, d), dtype, "cuda", seed=63)
    out = testing.empty_poisoned((n, hq, d), dtype, "cuda")
    ind = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    run_ragged(q, k, v, ind, ind, out, None, causal=True, sm_scale=d ** -0.5, max_qo_len=1, batch_size=n)
    torch.cuda.synchronize()
    want = v.to(dtype).repeat_interleave(hq // hkv, dim=1)
    bad = out != want  # by value: -0 comes out as +0 (the accumulator starts at +0)
    assert not bad.any(), f"{bad.sum().item()} of {out.numel()} values differ, e.g. {out[bad][:4]} for {want[bad][:4]}"


def test_entries_match_the_launchers():
    """The argument codes the loader binds are the C launchers' parameter lists, in order (a missing
    or swapped argument would be read as garbage, not rejected)."""
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from fi_attention.prefill.hopper.spec import PAGED_ENTRY, RAGGED_ENTRY  # noqa: PLC0415

    src = (Path(hopper.__file__).parent / "prefill_sm90.cu").read_text()
    codes = {"const void*": "ptr", "void*": "ptr", "int64_t": "i64", "float": "f32", "cudaStream_t": "stream"}
    for entry in (RAGGED_ENTRY, PAGED_ENTRY):
        params = re.search(rf"FI_EXPORT int {entry.name}\((.*?)\)\s*\{{", src, re.S).group(1)
        types = [re.sub(r"\s+", " ", p.strip()).rsplit(" ", 1)[0].replace(" *", "*") for p in params.split(",")]
        assert tuple(codes[t] for t in types) == entry.args, entry.name


def test_paged_page_size_rule():
    assert supports(**_facts(paged=True, page_size=16)) is None
    assert supports(**_facts(paged=True, page_size=256)) is None
    assert "page_size" in supports(**_facts(paged=True, page_size=1))
    assert "page_size" in supports(**_facts(paged=True, page_size=24))


@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_logits_soft_cap(causal):
    # logits are ~N(0, 1) here, so cap 2 bends them well into tanh's curved range
    _needs_sm90()
    _check([1000, 77], [1000, 300], causal=causal, softcap=2.0, seed=31)


# ---------------------------------------------------------------------------- GPU: persistent CTAs
# The kernel is persistent (one CTA per SM by default): each CTA walks a snake over the work tiles,
# carrying its pipeline stage/phase counters, Q buffer and ping-pong turns from tile to tile. With
# the small shapes above most CTAs get one tile, so here FI_FA3_CTAS forces 3 CTAs (dozens of
# tiles each, including skipped and key-less tiles) and "all" (one tile per CTA); both must match
# the reference and each other bit for bit (a tile's math does not depend on which CTA runs it).
@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [
    dict(qo_lens=[1000], kv_lens=[1000], causal=True),
    dict(qo_lens=[1000], kv_lens=[1000], causal=False, dtype=FP16),
    dict(qo_lens=[300, 7, 1000, 129], kv_lens=[50, 100, 1200, 700], causal=True),  # key-less tiles
    dict(qo_lens=[300, 7, 1000, 129], kv_lens=[50, 100, 1200, 700], causal=False),
    dict(qo_lens=[2000, 50], kv_lens=[2000, 300], causal=True, window_left=127),
    dict(qo_lens=[1, 300, 1000], kv_lens=[1, 777, 1000], causal=True, page_size=16),
    dict(qo_lens=[1, 300, 1000], kv_lens=[1, 777, 1000], causal=False, page_size=8, layout="HND"),
    dict(qo_lens=[1000], kv_lens=[1000], causal=True, d=256),
    dict(qo_lens=[1000, 77], kv_lens=[1000, 300], causal=True, d=64),
    # fp8 K/V: the widening lags the TMA issue by one KV tile, across work tiles
    dict(qo_lens=[300, 7, 1000, 129], kv_lens=[50, 100, 1200, 700], causal=True, kv_dtype=E4M3),
    dict(qo_lens=[1, 300, 1000], kv_lens=[1, 777, 1000], causal=True, page_size=16, kv_dtype=E4M3),
    dict(qo_lens=[1, 300, 1000], kv_lens=[1, 777, 1000], causal=False, page_size=128, kv_dtype=E5M2),
    dict(qo_lens=[1000, 77], kv_lens=[1000, 300], causal=True, d=64, page_size=8, layout="HND", kv_dtype=E4M3),
])
def test_persistent_many_tiles_per_cta(case):
    _needs_sm90()
    outs = []
    for ctas in ("3", "all", "1"):
        with knobs.override(FI_FA3_CTAS=ctas):
            out, lse = _check(**case, seed=37)
        outs.append((out, lse))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]), "result depends on the number of persistent CTAs"
        assert torch.equal(lse, outs[0][1]), "LSE depends on the number of persistent CTAs"


# ---------------------------------------------------------------------------- GPU: K/V multicast
# With FI_FA3_MULTICAST=1 an even GQA group at head_dim 128 runs the multicast module (2-CTA
# clusters, each CTA loading half of every K/V tile for both); odd groups and the default (0) run
# the single-CTA module. Both
# must match the reference and each other bit for bit (same math per tile), ragged and paged, on
# the default grid and on 3 CTAs (rounded to one cluster of 2 with multicast: many tiles per CTA).
@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [
    dict(qo_lens=[300, 7, 1000, 129], kv_lens=[50, 100, 1200, 700], causal=True, hq=8, hkv=4),
    dict(qo_lens=[1000, 77], kv_lens=[1000, 300], causal=False, hq=16, hkv=2, page_size=16),
    dict(qo_lens=[1, 300, 1000], kv_lens=[1, 777, 1000], causal=True, hq=4, hkv=2, page_size=8, layout="HND"),
    dict(qo_lens=[2000, 50], kv_lens=[2000, 300], causal=True, hq=6, hkv=2, window_left=127),  # group 3
])
def test_multicast_matches_single_cta(case):
    _needs_sm90()
    outs = []
    for mc in ("1", "0"):
        for ctas in (None, "3"):
            with knobs.override(FI_FA3_MULTICAST=mc, FI_FA3_CTAS=ctas):
                outs.append(_check(**case, seed=41))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]), "result depends on K/V multicast or the CTA count"
        assert torch.equal(lse, outs[0][1]), "LSE depends on K/V multicast or the CTA count"


# Under FI_FA3_MULTICAST=auto the wrappers pick the multicast module from their plan's pair count:
# 4 causal requests of 8192 tokens at 32/8 heads (2.2e12 FLOPs) take it, the same batch with
# FI_FA3_MULTICAST=0 does not, and both give the same bits; the last rows of a request match the
# fp32 reference.
@pytest.mark.gpu
@pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_auto_multicast_on_long_batches(paged, monkeypatch):
    _needs_sm90()
    from fi_attention.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    chosen = []
    real = hopper.use_multicast
    monkeypatch.setattr(hopper, "use_multicast", lambda *a: chosen.append(real(*a)) or chosen[-1])
    dev, n, L, hq, hkv, d, page = "cuda", 4, 8192, 32, 8, 128, 16
    q = testing.randn((n * L, hq, d), BF16, dev, seed=5)
    k = testing.randn((n * L, hkv, d), BF16, dev, seed=6)
    v = testing.randn((n * L, hkv, d), BF16, dev, seed=7)
    indptr = torch.arange(0, n * L + 1, L, dtype=torch.int32, device=dev)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    if paged:
        pages = n * L // page
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(3)).to(dev)
        cache = torch.empty((pages, 2, page, hkv, d), dtype=BF16, device=dev)
        cache[perm, 0] = k.view(pages, page, hkv, d)
        cache[perm, 1] = v.view(pages, page, hkv, d)
        w = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
        w.plan(indptr, torch.arange(0, pages + 1, L // page, dtype=torch.int32, device=dev), perm.to(torch.int32),
               torch.full((n,), page, dtype=torch.int32, device=dev), hq, hkv, d, page, causal=True,
               q_data_type=BF16)
        run = lambda: w.run(q, cache)  # noqa: E731
    else:
        w = BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
        w.plan(indptr, indptr, hq, hkv, d, causal=True, q_data_type=BF16)
        run = lambda: w.run(q, k, v)  # noqa: E731
    outs = {}
    for mode in ("auto", "0"):
        with knobs.override(FI_FA3_MULTICAST=mode):
            chosen.clear()
            outs[mode] = run()
            torch.cuda.synchronize()
            assert chosen == [mode == "auto"], f"FI_FA3_MULTICAST={mode}: multicast chosen {chosen}"
    assert torch.equal(outs["auto"], outs["0"]), "multicast (auto) and single-CTA results differ"
    rows = slice(L - 64, L)  # request 0's last 64 queries see all its keys but the causal tail
    ref = attention_reference(q[rows].float(), k[:L].float(), v[:L].float(), causal=True, sm_scale=d ** -0.5)
    got = outs["auto"][rows].float()
    testing.assert_close(got, ref, dtype=BF16, msg="auto multicast: ")
    assert testing.rel_error(got, ref) < 8e-3, f"auto multicast: rel. error {testing.rel_error(got, ref):.3e}"

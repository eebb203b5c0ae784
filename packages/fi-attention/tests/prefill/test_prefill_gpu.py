"""GPU tests of prefill (fa2 by default; FI_TEST_PREFILL_BACKEND=fa3 reruns them on the Hopper
kernel where it applies) against the fp32 reference.

Grid reduction: lengths {1, 7, 127, 1000, 4097} appear as (qo, kv) pairs chosen to cover
qo == kv, qo < kv, qo > kv and one-tile/multi-tile/ragged-tail cases instead of the full product;
heads are 4/1, 8/2 and 8/8 instead of 32/8 (the kernel is head-count agnostic: heads only index
pointers); features are tested at d=128 bf16 plus one other dtype/dim each.
"""

import contextlib
import os
import warnings

import numpy as np
import pytest
import torch

from fi_core import testing
from fi_core.errors import UnsupportedError
from fi_attention.prefill import (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
                                  single_prefill_with_kv_cache)
from fi_attention.reference import attention_reference, rope_llama

pytestmark = testing.gpu_only()
BACKEND = os.environ.get("FI_TEST_PREFILL_BACKEND", "fa2")


@contextlib.contextmanager
def _backend_may_refuse():
    """Under FI_TEST_PREFILL_BACKEND=fa3, a case that backend does not support is skipped."""
    try:
        yield
    except UnsupportedError as exc:
        if BACKEND == "fa2":
            raise
        pytest.skip(f"{BACKEND} does not run this case: {exc}")
# Output tolerance: P is rounded to the input type before P @ V (as every fa2/fa3 kernel does),
# so the error is ~2^-8 (bf16) / 2^-11 (fp16) of |v| on top of the output rounding.
TOL = {torch.bfloat16: (1.6e-2, 1.6e-2, 8e-3), torch.float16: (3e-3, 3e-3, 1.5e-3)}  # atol, rtol, rel 2-norm
LSE_TOL = dict(atol=2e-3, rtol=1e-3)


def _test_specs(arch, backend=BACKEND):
    """Every fa2 variant these tests launch, so one parallel build (FI_MAX_JOBS) warms them all,
    and the fa3 modules they launch on sm_90a when run on `backend`."""
    from fi_attention.prefill.spec import fa2_spec  # noqa: PLC0415

    bf, f16 = torch.bfloat16, torch.float16
    specs = [fa2_spec(bf, 128, 128, paged, arch, **kw) for paged in (False, True)
             for kw in ({}, {"kv_dtype": torch.float8_e4m3fn})]
    specs += [fa2_spec(bf, 128, 128, False, arch, **{k: True}) for k in ("custom_mask", "softcap", "alibi", "rope")]
    specs += [fa2_spec(dt, a, b, False, arch) for dt in (bf, f16) for a, b in ((64, 64), (256, 256), (192, 128))]
    specs += [fa2_spec(f16, 128, 128, False, arch), fa2_spec(f16, 128, 128, False, arch, kv_dtype=torch.float8_e5m2)]
    specs += [fa2_spec(dt, d, d, False, arch, kv_dtype=kv) for dt, kv, d in (  # the widening's exactness
        (bf, torch.float8_e5m2, 128), (f16, torch.float8_e4m3fn, 128), (f16, torch.float8_e5m2, 64),
        (bf, torch.float8_e4m3fn, 256), (bf, torch.float8_e5m2, 64))]
    specs += [fa2_spec(bf, a, b, False, arch, rope=True) for a, b in ((64, 64), (192, 128))]
    specs += [fa2_spec(bf, 64, 64, True, arch)]  # cascade test
    specs += [fa2_spec(bf, 256, 256, True, arch)]
    specs += [fa2_spec(bf, 128, 128, True, arch, softcap=True)]
    specs += [fa2_spec(bf, 128, 128, paged, arch, short=True) for paged in (False, True)]  # short batches
    specs += [fa2_spec(bf, d, d, False, arch, **kw) for d in (64, 256)  # custom mask / window at d 64, 256
              for kw in ({"custom_mask": True}, {"softcap": True})]
    specs += [fa2_spec(bf, 128, 128, True, arch, **{k: True}) for k in ("alibi", "rope")]  # paged positions
    specs += [fa2_spec(bf, d, d, True, arch, custom_mask=True, kv_dtype=kv)  # paged custom masks
              for d, kv in ((128, bf), (256, bf), (256, torch.float8_e4m3fn), (64, bf))]
    specs += [fa2_spec(bf, 128, 128, False, arch, custom_mask=True, softcap=True)]  # mask + window + cap
    if arch.cc == 90 and arch.suffix == "a":  # the fa3 custom-mask modules the mask tests launch
        from fi_attention.prefill.hopper.spec import prefill_sm90_spec  # noqa: PLC0415

        specs += [prefill_sm90_spec(bf, d, False, arch, paged=paged, custom_mask=True)
                  for d in (64, 128, 256) for paged in (False, True)]
        specs += [prefill_sm90_spec(bf, d, False, arch, custom_mask=True, softcap=True) for d in (64, 128, 256)]
        # fp8 K/V on fa3 (and auto): single prefill with scales, the paged wrapper
        specs += [prefill_sm90_spec(bf, 128, True, arch, kv_dtype=torch.float8_e4m3fn),
                  prefill_sm90_spec(f16, 128, True, arch, kv_dtype=torch.float8_e5m2),
                  prefill_sm90_spec(bf, 128, True, arch, paged=True, kv_dtype=torch.float8_e4m3fn)]
        if backend == "fa3":  # the paged cases beyond d = 128 causal, rerun on fa3
            specs += [prefill_sm90_spec(bf, d, True, arch, paged=True) for d in (64, 256)]
            specs += [prefill_sm90_spec(bf, 128, False, arch, paged=True),
                      prefill_sm90_spec(bf, 128, True, arch, paged=True, softcap=True)]
    return specs


def _fa3_or_skip(backend):
    if backend == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs an sm_90 GPU")


@pytest.fixture(scope="module", autouse=True)
def _warm_kernels():
    from fi_core import arch_of, build_many  # noqa: PLC0415

    build_many(_test_specs(arch_of(torch.device("cuda"))))


def _close(out, ref, dtype, what=""):
    atol, rtol, rel = TOL[dtype]
    testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=what)
    assert testing.rel_error(out, ref) < rel, f"{what}: rel. error {testing.rel_error(out, ref):.3e}"


def _qkv(lq, lkv, hq, hkv, dqk, dvo, dtype, seed):
    return (testing.randn((lq, hq, dqk), dtype, "cuda", seed=seed),
            testing.randn((lkv, hkv, dqk), dtype, "cuda", seed=seed + 1),
            testing.randn((lkv, hkv, dvo), dtype, "cuda", seed=seed + 2))


LENGTHS = [(1, 1), (7, 7), (127, 127), (1000, 1000), (7, 1000), (1, 4097), (127, 4097), (1000, 127), (4097, 4097)]


@pytest.mark.parametrize("lq,lkv", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_single_prefill_lengths(lq, lkv, causal):
    q, k, v = _qkv(lq, lkv, 8, 2, 128, 128, torch.bfloat16, seed=lq + lkv)
    with _backend_may_refuse():
        out, lse = single_prefill_with_kv_cache(q, k, v, causal=causal, backend=BACKEND, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    _close(out, ref, torch.bfloat16, f"lq={lq} lkv={lkv} causal={causal}: ")
    testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dqk,dvo", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("heads", [(4, 1), (8, 8)])
def test_single_prefill_dims_dtypes_heads(dtype, dqk, dvo, heads):
    hq, hkv = heads
    q, k, v = _qkv(300, 517, hq, hkv, dqk, dvo, dtype, seed=dqk)
    out, lse = single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, backend="fa2")
    ref, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    _close(out, ref, dtype)
    testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "mask", "hnd", "noncontig", "scale"])
def test_single_prefill_features(feature):
    lq, lkv = 200, 700
    q, k, v = _qkv(lq, lkv, 8, 2, 128, 128, torch.bfloat16, seed=11)
    kw, rkw = {"causal": True}, {"causal": True}
    kk, vv = k, v
    if feature == "window":
        kw["window_left"] = rkw["window_left"] = 97
    elif feature == "softcap":
        kw["logits_soft_cap"] = rkw["logits_soft_cap"] = 5.0
        q = q * 4
    elif feature == "alibi":
        kw["pos_encoding_mode"] = rkw["pos_encoding_mode"] = "ALIBI"
    elif feature == "mask":
        m = testing.rand((lq, lkv), seed=2) > 0.5
        m[17] = False  # a fully masked row: out 0, lse -inf
        kw, rkw = {"custom_mask": m.cuda()}, {"custom_mask": m}
    elif feature == "hnd":
        kk, vv = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        kw["kv_layout"] = "HND"
    elif feature == "noncontig":
        big = testing.randn((lkv, 2, 4, 128), torch.bfloat16, "cuda", seed=5)
        kk, vv = big[:, 0, :2], big[:, 1, 1:3]
        k, v = kk, vv
    elif feature == "scale":
        kw["sm_scale"] = rkw["sm_scale"] = 0.05
    out, lse = single_prefill_with_kv_cache(q, kk, vv, backend="fa2", return_lse=True, **kw)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **rkw)
    _close(out, ref, torch.bfloat16, feature + ": ")
    testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("lq,lkv", [(200, 700), (300, 129)])
def test_single_prefill_custom_mask_fa3(d, lq, lkv):
    """The fa3 kernel's custom masks (every KV tile masked; tile tails; qo > kv) with a fully
    masked row (out 0, lse -inf) and a fully visible one, against the reference and fa2."""
    _fa3_or_skip("fa3")
    q, k, v = _qkv(lq, lkv, 8, 2, d, d, torch.bfloat16, seed=d + lq)
    m = testing.rand((lq, lkv), seed=3) > 0.5
    m[17] = False
    m[18] = True
    out, lse = single_prefill_with_kv_cache(q, k, v, custom_mask=m.cuda(), backend="fa3", return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, custom_mask=m, return_lse=True)
    _close(out, ref, torch.bfloat16, f"fa3 mask d={d}: ")
    testing.assert_close(lse, ref_lse, **LSE_TOL)
    assert lse[17].isneginf().all() and (out[17] == 0).all()
    two = single_prefill_with_kv_cache(q, k, v, custom_mask=m.cuda(), backend="fa2")
    _close(out, two.float(), torch.bfloat16, "fa3 vs fa2: ")


@pytest.mark.parametrize("backend,d", [("fa2", 128), ("fa3", 128), ("fa3", 64), ("fa3", 256)])
def test_custom_mask_with_window_and_softcap(backend, d):
    """A custom mask, a sliding window and a soft cap together (the window skips whole KV tiles on
    fa3, so the mask's first visited tile is not tile 0), with qo < kv and rows the window and the
    mask empty together."""
    _fa3_or_skip(backend)
    lq, lkv, window = 300, 1000, 77
    q, k, v = _qkv(lq, lkv, 8, 2, d, d, torch.bfloat16, seed=40 + d)
    m = testing.rand((lq, lkv), seed=41) > 0.5
    m[5, lkv - lq + 5 - window:] = False  # row 5: nothing inside its window is visible
    kw = dict(window_left=window, logits_soft_cap=30.0)
    out, lse = single_prefill_with_kv_cache(q, k, v, custom_mask=m.cuda(), backend=backend, return_lse=True, **kw)
    ref, ref_lse = attention_reference(q, k, v, custom_mask=m, return_lse=True, **kw)
    _close(out, ref, torch.bfloat16, f"{backend} mask + window d={d}: ")
    testing.assert_close(lse, ref_lse, **LSE_TOL)
    assert lse[5].isneginf().all() and (out[5] == 0).all()


@pytest.mark.parametrize("dqk,dvo", [(128, 128), (64, 64), (192, 128)])
def test_single_prefill_rope_llama(dqk, dvo):
    # The kernel rotates q/k in fp32 and rounds them to the input type before the mma (as
    # FlashInfer); the oracle is the reference on q/k rotated the same way.
    lq, lkv = 300, 1000
    q, k, v = _qkv(lq, lkv, 8, 2, dqk, dvo, torch.bfloat16, seed=21)
    out, lse = single_prefill_with_kv_cache(q, k, v, causal=True, pos_encoding_mode="ROPE_LLAMA",
                                            rope_theta=5e5, backend="fa2", return_lse=True)
    qpos = torch.arange(lq) + (lkv - lq)
    qr = rope_llama(q.float().cpu(), qpos, 1.0, 5e5).to(torch.bfloat16)
    kr = rope_llama(k.float().cpu(), torch.arange(lkv), 1.0, 5e5).to(torch.bfloat16)
    ref, ref_lse = attention_reference(qr, kr, v.cpu(), causal=True, return_lse=True)
    _close(out, ref, torch.bfloat16)
    testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-3)  # angle error of fp32 sincos at pos ~1e3


@pytest.mark.parametrize("backend", ["fa2", "fa3", "auto"])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2)])
def test_single_prefill_fp8_kv_with_scales(dtype, kv_dtype, backend):
    _fa3_or_skip(backend)
    lq, lkv = 257, 1000
    q, k, v = _qkv(lq, lkv, 8, 2, 128, 128, dtype, seed=31)
    k8, v8 = k.to(kv_dtype), v.to(kv_dtype)
    out, lse = single_prefill_with_kv_cache(q, k8, v8, causal=True, scale_k=0.5, scale_v=2.0,
                                            backend=backend, return_lse=True)
    ref, ref_lse = attention_reference(q, k8, v8, causal=True, k_scale=0.5, v_scale=2.0, return_lse=True)
    _close(out, ref, dtype)
    testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("dtype,kv_dtype,d", [
    (torch.bfloat16, torch.float8_e4m3fn, 128), (torch.bfloat16, torch.float8_e5m2, 128),
    (torch.float16, torch.float8_e4m3fn, 128), (torch.float16, torch.float8_e5m2, 64),
    (torch.bfloat16, torch.float8_e4m3fn, 256), (torch.bfloat16, torch.float8_e5m2, 64)])
def test_fa2_fp8_widening_is_exact(dtype, kv_dtype, d):
    """One key: every query's output is that key's V row (P = 1 exactly), so fa2's widening of every
    finite fp8 byte must equal torch's bit for bit; with scale_v = 2 the output is twice that."""
    hkv = 256 // d  # the 256 byte values over the heads of one V row
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.where(torch.isfinite(codes.view(kv_dtype).float()), codes, torch.zeros_like(codes))
    v = codes[torch.randperm(256, generator=testing.generator(71))].reshape(1, hkv, d).view(kv_dtype).cuda()
    k = testing.randn((1, hkv, d), dtype, "cuda", seed=72).to(kv_dtype)
    q = testing.randn((40, 2 * hkv, d), dtype, "cuda", seed=73)  # 80 packed rows: not the short kernel
    want = v.to(dtype).repeat_interleave(2, dim=1).expand(40, -1, -1)
    out = single_prefill_with_kv_cache(q, k, v, backend="fa2")
    bad = out != want  # by value: -0 comes out as +0 (the accumulator starts at +0)
    assert not bad.any(), f"{bad.sum().item()} of {out.numel()} differ, e.g. {out[bad][:4]} for {want[bad][:4]}"
    out = single_prefill_with_kv_cache(q, k, v, backend="fa2", scale_v=2.0)
    assert torch.equal(out, want * 2)


def _lens(batch, seed):
    rng = np.random.default_rng(seed)
    qo = rng.choice([0, 1, 7, 127, 300], size=batch)
    kv = qo + rng.choice([0, 0, 5, 900], size=batch)
    kv[rng.random(batch) < 0.1] = 0  # empty kv with queries: out 0, lse -inf
    return qo.tolist(), kv.tolist()


def _indptr(lens):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)


def _per_request_ref(q, k, v, qo, kv, **kw):
    outs, lses, a, c = [], [], 0, 0
    for lq, lk in zip(qo, kv):
        o, lse = attention_reference(q[a:a + lq], k[c:c + lk], v[c:c + lk], return_lse=True, **kw)
        outs.append(o)
        lses.append(lse)
        a, c = a + lq, c + lk
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("batch", [1, 7, 33])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_batch(batch, causal):
    qo, kv = _lens(batch, batch)
    q, k, v = _qkv(sum(qo), sum(kv), 8, 2, 128, 128, torch.bfloat16, seed=batch)
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), backend=BACKEND)
    out = testing.empty_poisoned(q.shape, q.dtype, "cuda")
    lse = testing.empty_poisoned(q.shape[:2], torch.float32, "cuda")
    with _backend_may_refuse():
        w.plan(_indptr(qo), _indptr(kv), 8, 2, 128, causal=causal, q_data_type=torch.bfloat16)
        w.run(q, k, v, out=out, lse=lse)
    ref, ref_lse = _per_request_ref(q, k, v, qo, kv, causal=causal)
    _close(out, ref, torch.bfloat16)
    testing.assert_close(lse, ref_lse, **LSE_TOL)
    # batch == single per request, on the backend under test: with the default "auto" an fa2 run
    # launched fa3 here, and a hung fa3 kernel read as an fa2 ragged-batch hang.
    a, c = 0, 0
    for lq, lk in zip(qo, kv):
        if lq:
            with _backend_may_refuse():
                one = single_prefill_with_kv_cache(q[a:a + lq], k[c:c + lk], v[c:c + lk], causal=causal,
                                                   backend=BACKEND)
            _close(out[a:a + lq], one.float(), torch.bfloat16)
        a, c = a + lq, c + lk


def test_ragged_split_kv_short_queries_long_kv():
    qo, kv = [1, 3, 1, 2], [4097, 9000, 1, 20000]  # few rows over long KV: the planner splits
    q, k, v = _qkv(sum(qo), sum(kv), 8, 2, 128, 128, torch.bfloat16, seed=3)
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), backend="fa2")
    w.plan(_indptr(qo), _indptr(kv), 8, 2, 128, causal=True, q_data_type=torch.bfloat16)
    assert w._schedule.plan.num_slots > 0
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = _per_request_ref(q, k, v, qo, kv, causal=True)
    _close(out, ref, torch.bfloat16)
    testing.assert_close(lse, ref_lse, **LSE_TOL)


def _paged(kv, k, v, page_size, layout, seed):
    pages = [(n + page_size - 1) // page_size for n in kv]
    total = sum(pages) + 5
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:sum(pages)]
    kc = testing.randn((total, page_size, k.shape[1], k.shape[2]), k.dtype, "cuda", seed=seed + 7)
    vc = testing.randn((total, page_size, v.shape[1], v.shape[2]), v.dtype, "cuda", seed=seed + 8)
    pos, ptr = 0, 0
    for n, np_ in zip(kv, pages):
        for i in range(np_):
            m = min(page_size, n - i * page_size)
            kc[perm[ptr + i], :m] = k[pos + i * page_size: pos + i * page_size + m]
            vc[perm[ptr + i], :m] = v[pos + i * page_size: pos + i * page_size + m]
        pos, ptr = pos + n, ptr + np_
    last = torch.tensor([n - (p - 1) * page_size if p else 1 for n, p in zip(kv, pages)], dtype=torch.int32)
    if layout == "HND":
        kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    return (kc, vc), _indptr(pages), perm.to(torch.int32), last


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_paged_matches_ragged(page_size, layout, as_tensor):
    qo, kv = _lens(9, page_size)
    q, k, v = _qkv(sum(qo), sum(kv), 8, 2, 128, 128, torch.bfloat16, seed=page_size)
    (kc, vc), indptr, indices, last = _paged(kv, k, v, page_size, layout, seed=1)
    cache = torch.stack([kc, vc], dim=1) if as_tensor else (kc, vc)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    p = BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout=layout, backend=BACKEND)
    with _backend_may_refuse():
        p.plan(_indptr(qo), indptr, indices, last, 8, 2, 128, page_size, causal=True, q_data_type=torch.bfloat16)
        out, lse = p.run(q, cache, return_lse=True)
    r = BatchPrefillWithRaggedKVCacheWrapper(ws, backend=BACKEND)
    r.plan(_indptr(qo), _indptr(kv), 8, 2, 128, causal=True, q_data_type=torch.bfloat16)
    out_r, lse_r = r.run(q, k, v, return_lse=True)
    ref, ref_lse = _per_request_ref(q, k, v, qo, kv, causal=True)
    _close(out, ref, torch.bfloat16)
    testing.assert_close(lse, ref_lse, **LSE_TOL)
    _close(out_r, ref, torch.bfloat16, "ragged: ")
    testing.assert_close(lse_r, ref_lse, **LSE_TOL)


def test_paged_page_ids_checked_with_fi_check_inputs():
    """Page ids past the cache raise before the launch when FI_CHECK_INPUTS=1 (a device read);
    a plan() that raised leaves the wrapper unplanned on the GPU too."""
    from fi_core import knobs
    from fi_core.errors import InputError
    qo, kv = [3, 5], [20, 40]
    q, k, v = _qkv(sum(qo), sum(kv), 8, 2, 128, 128, torch.bfloat16, seed=3)
    (kc, vc), indptr, indices, last = _paged(kv, k, v, 16, "NHD", seed=3)
    bad = indices.clone()
    bad[2] = kc.shape[0]
    p = BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), backend=BACKEND)
    with _backend_may_refuse():
        p.plan(_indptr(qo), indptr, bad.cuda(), last, 8, 2, 128, 16, causal=True, q_data_type=torch.bfloat16)
        with knobs.override(FI_CHECK_INPUTS="1"):
            with pytest.raises(InputError, match=rf"paged_kv_indices must be in \[0, {kc.shape[0]}\)"):
                p.run(q, (kc, vc))
        with pytest.raises(InputError, match="window_left"):
            p.plan(_indptr(qo), indptr, indices.cuda(), last, 8, 2, 128, 16, window_left=-3)
        with pytest.raises(InputError, match="call plan"):
            p.run(q, (kc, vc))
        p.plan(_indptr(qo), indptr, indices.cuda(), last, 8, 2, 128, 16, causal=True, q_data_type=torch.bfloat16)
        ref, _ = _per_request_ref(q, k, v, qo, kv, causal=True)
        _close(p.run(q, (kc, vc)), ref, torch.bfloat16)


@pytest.mark.parametrize("dqk,dvo,page_size,feature", [
    (64, 64, 5, None), (256, 256, 5, None), (128, 128, 7, "window_softcap"), (128, 128, 3, "hnd_noncausal")])
def test_paged_head_dims_odd_pages_features(dqk, dvo, page_size, feature):
    """Paged KV at every paged head dim with page sizes that are not powers of two, so kv tiles
    start and end inside pages and the per-row offset table holds several pages per tile, plus
    window + soft cap and HND without causality at d = 128."""
    qo, kv = [1, 130, 64, 300], [70, 130, 1000, 301]
    layout = "HND" if feature == "hnd_noncausal" else "NHD"
    kw = dict(causal=feature != "hnd_noncausal")
    if feature == "window_softcap":
        kw.update(window_left=100, logits_soft_cap=30.0)
    q, k, v = _qkv(sum(qo), sum(kv), 8, 2, dqk, dvo, torch.bfloat16, seed=dqk + page_size)
    (kc, vc), indptr, indices, last = _paged(kv, k, v, page_size, layout, seed=3)
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                            kv_layout=layout, backend=BACKEND)
    with _backend_may_refuse():
        w.plan(_indptr(qo), indptr, indices, last, 8, 2, dqk, page_size, head_dim_vo=dvo,
               q_data_type=torch.bfloat16, **kw)
        out, lse = w.run(q, (kc, vc), return_lse=True)
    ref, ref_lse = _per_request_ref(q, k, v, qo, kv, **kw)
    _close(out, ref, torch.bfloat16)
    testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("mode", ["ALIBI", "ROPE_LLAMA"])
def test_paged_position_encodings(mode):
    """Paged d = 128 with ALiBi or Llama RoPE in the kernel (kv tiles of 64 on sm_90) on pages of
    7 tokens, against the reference per request (RoPE: q / k rotated at their positions first,
    q at the bottom-right aligned ones)."""
    qo, kv = [1, 130, 64, 300], [70, 130, 1000, 301]
    q, k, v = _qkv(sum(qo), sum(kv), 8, 2, 128, 128, torch.bfloat16, seed=41)
    (kc, vc), indptr, indices, last = _paged(kv, k, v, 7, "NHD", seed=4)
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), backend="fa2")
    w.plan(_indptr(qo), indptr, indices, last, 8, 2, 128, 7, causal=True, pos_encoding_mode=mode,
           rope_theta=5e5, q_data_type=torch.bfloat16)
    out, lse = w.run(q, (kc, vc), return_lse=True)
    if mode == "ALIBI":
        ref, ref_lse = _per_request_ref(q, k, v, qo, kv, causal=True, pos_encoding_mode="ALIBI")
    else:
        qr, kr, a, c = [], [], 0, 0
        for lq, lk in zip(qo, kv):
            qr.append(rope_llama(q[a:a + lq].float().cpu(), torch.arange(lq) + (lk - lq), 1.0, 5e5))
            kr.append(rope_llama(k[c:c + lk].float().cpu(), torch.arange(lk), 1.0, 5e5))
            a, c = a + lq, c + lk
        ref, ref_lse = _per_request_ref(torch.cat(qr).to(torch.bfloat16), torch.cat(kr).to(torch.bfloat16),
                                        v.cpu(), qo, kv, causal=True)
    _close(out, ref, torch.bfloat16, mode + ": ")
    testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-3)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_paged_fp8_kv(backend):
    _fa3_or_skip(backend)
    qo, kv = [5, 127, 300], [40, 1000, 300]
    q, k, v = _qkv(sum(qo), sum(kv), 8, 2, 128, 128, torch.bfloat16, seed=6)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    # Build the cache in fp32 (exact for fp8 values), then store it as fp8.
    (kc, vc), indptr, indices, last = _paged(kv, k8.float(), v8.float(), 16, "NHD", seed=2)
    cache = (kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn))
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), backend=backend)
    w.plan(_indptr(qo), indptr, indices, last, 8, 2, 128, 16, causal=True, q_data_type=torch.bfloat16,
           kv_data_type=torch.float8_e4m3fn)
    out = w.run(q, cache, k_scale=0.25, v_scale=3.0)
    ref, _ = _per_request_ref(q, k8, v8, qo, kv, causal=True, k_scale=0.25, v_scale=3.0)
    _close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_batch_custom_mask_and_window(d, backend):
    _fa3_or_skip(backend)
    qo, kv = [5, 127, 0, 64], [40, 127, 9, 700]
    q, k, v = _qkv(sum(qo), sum(kv), 8, 2, d, d, torch.bfloat16, seed=4)
    masks = [testing.rand((a, b), seed=i) > 0.3 for i, (a, b) in enumerate(zip(qo, kv))]
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), backend=backend)
    w.plan(_indptr(qo), _indptr(kv), 8, 2, d, custom_mask=torch.cat([m.flatten() for m in masks]).cuda(),
           q_data_type=torch.bfloat16)
    out = w.run(q, k, v)
    a, c = 0, 0
    for (lq, lk), m in zip(zip(qo, kv), masks):
        if lq:
            _close(out[a:a + lq], attention_reference(q[a:a + lq], k[c:c + lk], v[c:c + lk], custom_mask=m), torch.bfloat16)
        a, c = a + lq, c + lk
    w.plan(_indptr(qo), _indptr(kv), 8, 2, d, causal=True, window_left=33, logits_soft_cap=30.0,
           q_data_type=torch.bfloat16)
    out = w.run(q, k, v)
    ref, _ = _per_request_ref(q, k, v, qo, kv, causal=True, window_left=33, logits_soft_cap=30.0)
    _close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("backend,d,kv_dtype,page_size", [
    ("fa2", 128, torch.bfloat16, 16), ("fa2", 256, torch.bfloat16, 5), ("fa2", 256, torch.float8_e4m3fn, 7),
    ("fa2", 64, torch.bfloat16, 1), ("fa3", 128, torch.bfloat16, 16), ("fa3", 64, torch.bfloat16, 8),
    ("fa3", 256, torch.bfloat16, 16)])
def test_paged_custom_mask(backend, d, kv_dtype, page_size):
    """Custom masks on a paged cache (tiles straddle pages; rows whose mask bits start mid-byte),
    including short queries over long KV (fa2 splits them along KV, so a chunk's first key is not a
    tile multiple) and an empty request."""
    _fa3_or_skip(backend)
    qo, kv = [3, 130, 0, 1], [3001, 131, 9, 9000]
    q, k, v = _qkv(sum(qo), sum(kv), 8, 2, d, d, torch.bfloat16, seed=d + page_size)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    scale = dict(k_scale=0.5, v_scale=2.0) if kv_dtype != torch.bfloat16 else {}
    masks = [testing.rand((a, b), seed=20 + i) > 0.4 for i, (a, b) in enumerate(zip(qo, kv))]
    (kc, vc), indptr, indices, last = _paged(kv, k.float(), v.float(), page_size, "NHD", seed=5)  # exact
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), backend=backend)
    w.plan(_indptr(qo), indptr, indices, last, 8, 2, d, page_size,
           custom_mask=torch.cat([m.flatten() for m in masks]).cuda(), q_data_type=torch.bfloat16,
           kv_data_type=kv_dtype)
    if backend == "fa2":
        assert w._schedule.plan.num_slots > 0  # the long requests were split along KV
    out, lse = w.run(q, (kc, vc), return_lse=True, **scale)
    a, c = 0, 0
    for (lq, lk), m in zip(zip(qo, kv), masks):
        if lq:
            ref, ref_lse = attention_reference(q[a:a + lq], k[c:c + lk], v[c:c + lk], custom_mask=m,
                                               return_lse=True, **scale)
            _close(out[a:a + lq], ref, torch.bfloat16, f"request at {a}: ")
            testing.assert_close(lse[a:a + lq], ref_lse, **LSE_TOL)
        a, c = a + lq, c + lk


class _GraphPaged:
    """A CUDA-graph paged wrapper for 3 requests over fixed q / out / cache buffers (NHD, page 16,
    GQA 8/2, d128, bf16), and a graph of one run() captured on a side stream."""
    ps, hq, hkv, d = 16, 8, 2, 128

    def __init__(self, backend, n_q, n_pages):
        dev, i32, bf16 = "cuda", torch.int32, torch.bfloat16
        ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
        self.w = BatchPrefillWithPagedKVCacheWrapper(
            ws, use_cuda_graph=True, backend=backend, qo_indptr_buf=torch.zeros(4, dtype=i32, device=dev),
            paged_kv_indptr_buf=torch.zeros(4, dtype=i32, device=dev),
            paged_kv_indices_buf=torch.zeros(n_pages, dtype=i32, device=dev),
            paged_kv_last_page_len_buf=torch.zeros(3, dtype=i32, device=dev))
        self.q = torch.zeros(n_q, self.hq, self.d, dtype=bf16, device=dev)
        self.out = torch.zeros_like(self.q)
        self.k = torch.zeros(n_pages, self.ps, self.hkv, self.d, dtype=bf16, device=dev)
        self.v = torch.zeros_like(self.k)

    def setup(self, qo, kv, seed, plan_qo=None):
        """Plans requests of qo / kv tokens (plan_qo: the query lengths planned, default qo) and
        fills the buffers; returns the dense q, k, v for the reference."""
        q, k, v = _qkv(sum(qo), sum(kv), self.hq, self.hkv, self.d, self.d, torch.bfloat16, seed)
        (kc, vc), indptr, indices, last = _paged(kv, k, v, self.ps, "NHD", seed)
        self.w.plan(_indptr(plan_qo or qo), indptr, indices, last, self.hq, self.hkv, self.d, self.ps, causal=False,
                    q_data_type=torch.bfloat16)
        self.q.zero_()
        self.q[:sum(qo)] = q
        self.k[:kc.shape[0]], self.v[:vc.shape[0]] = kc, vc
        return q, k, v

    def capture(self) -> torch.cuda.CUDAGraph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.w.run(self.q, (self.k, self.v), out=self.out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            self.w.run(self.q, (self.k, self.v), out=self.out)
        return g

    def replay_matches(self, g, qo, kv, seed, plan_qo=None):
        q, k, v = self.setup(qo, kv, seed, plan_qo)
        self.out.zero_()
        g.replay()
        torch.cuda.synchronize()
        ref, _ = _per_request_ref(q, k, v, qo, kv, causal=False)
        _close(self.out[:sum(qo)], ref, torch.bfloat16, f"replay {seed}: ")


def test_paged_cuda_graph_replays_a_new_plan():
    qo1, kv1 = [7, 100, 1], [30, 400, 2000]
    qo2, kv2 = [50, 1, 9], [60, 3000, 9]
    t = _GraphPaged("fa2", n_q=200, n_pages=400)

    def pad(qo):  # the last request padded to the fixed q size (non-causal: the real rows are unchanged)
        return qo[:-1] + [qo[-1] + 200 - sum(qo)]

    t.setup(qo1, kv1, 1, pad(qo1))
    g = t.capture()
    for qo, kv, seed in ((qo1, kv1, 1), (qo2, kv2, 2)):
        t.replay_matches(g, qo, kv, seed, pad(qo))


def test_fa3_cuda_graph_covers_the_longest_plan_before_capture():
    """fa3 in CUDA-graph mode walks the query blocks of the longest request of every plan so far
    (a launch argument the graph keeps): a graph captured after a plan of short requests replays a
    re-plan of the earlier longer batch correctly, and a plan longer than any before the capture
    warns. Without the bound the capture would cover 2 of the long request's 4 query blocks."""
    _fa3_or_skip("fa3")
    long_qo, long_kv = [7, 500, 5], [600, 900, 300]
    short_qo, short_kv = [171, 171, 170], [200, 171, 1000]
    t = _GraphPaged("fa3", n_q=512, n_pages=200)
    t.setup(long_qo, long_kv, 1)
    t.setup(short_qo, short_kv, 2)
    g = t.capture()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="CUDA-graph prefill")  # no plan below the bound warns
        for qo, kv, seed in ((long_qo, long_kv, 3), (short_qo, short_kv, 4)):
            t.replay_matches(g, qo, kv, seed)
    with pytest.warns(UserWarning, match="longest request of 510 queries"):
        t.setup([1, 510, 1], [16, 600, 16], 5)

def test_deterministic():
    q, k, v = _qkv(1000, 4097, 8, 2, 128, 128, torch.bfloat16, seed=9)
    a = single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2")
    b = single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2")
    assert torch.equal(a, b)

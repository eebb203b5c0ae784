"""CPU tests of decode: the reference against a naive formula, validation errors, CPU backend."""

import math

import pytest
import torch

from fi_core import knobs, testing
from fi_core.errors import InputError, InputTypeError
from fi_attention import BatchDecodeWithPagedKVCacheWrapper, single_decode_with_kv_cache
from fi_attention.reference import alibi_slopes, attention_reference, gather_paged_kv


def naive_attention(q, k, v, *, causal=False, sm_scale=None, cap=None, window_left=-1, rope=False,
                    alibi=False, mask=None, k_scale=1.0, v_scale=1.0):
    """Loops over heads, queries and keys in float64: an independent definition."""
    lq, hq, d = q.shape
    lkv, hkv, dv = v.shape
    g = hq // hkv
    scale = (1 / math.sqrt(d) if sm_scale is None else sm_scale) * k_scale
    q, k, v = q.double(), k.double(), v.double()

    def rot(x, pos):
        y = x.clone()
        for i in range(d // 2):
            th = pos / (1e4 ** (2 * i / d))
            c, s = math.cos(th), math.sin(th)
            y[i] = x[i] * c - x[i + d // 2] * s
            y[i + d // 2] = x[i + d // 2] * c + x[i] * s
        return y

    n = hq
    p2 = 2 ** math.floor(math.log2(n))
    slopes = [2 ** (-8 * (h + 1) / p2) for h in range(p2)] + [2 ** (-4 * (2 * m + 1) / p2) for m in range(n - p2)]
    out = torch.zeros(lq, hq, dv, dtype=torch.float64)
    lse = torch.full((lq, hq), -math.inf, dtype=torch.float64)
    for h in range(hq):
        for i in range(lq):
            p = lkv - lq + i
            qi = rot(q[i, h], p) if rope else q[i, h]
            logits, vals = [], []
            for j in range(lkv):
                if causal and j > p:
                    continue
                if window_left >= 0 and j < p - window_left:
                    continue
                if mask is not None and not mask[i, j]:
                    continue
                kj = rot(k[j, h // g], j) if rope else k[j, h // g]
                s = float(qi @ kj) * scale
                if cap:
                    s = cap * math.tanh(s / cap)
                if alibi:
                    s += slopes[h] * (j - p)
                logits.append(s)
                vals.append(v[j, h // g])
            if logits:
                m = max(logits)
                w = [math.exp(s - m) for s in logits]
                tot = sum(w)
                out[i, h] = sum(wi * vi for wi, vi in zip(w, vals)) / tot * v_scale
                lse[i, h] = (m + math.log(tot)) / math.log(2)
    return out, lse


CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, window_left=2),
    dict(logits_soft_cap=5.0),
    dict(pos_encoding_mode="ROPE_LLAMA"),
    dict(pos_encoding_mode="ALIBI"),
    dict(k_scale=0.5, v_scale=2.0, sm_scale=0.3),
]


@pytest.mark.parametrize("opts", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("lq,lkv", [(1, 9), (3, 7), (4, 4)])
def test_reference_matches_naive(opts, lq, lkv):
    q = testing.randn((lq, 6, 16), seed=1)
    k = testing.randn((lkv, 2, 16), seed=2)
    v = testing.randn((lkv, 2, 16), seed=3)
    out, lse = attention_reference(q, k, v, return_lse=True, **opts)
    nopts = dict(causal=opts.get("causal", False), sm_scale=opts.get("sm_scale"),
                 cap=opts.get("logits_soft_cap"), window_left=opts.get("window_left", -1),
                 rope=opts.get("pos_encoding_mode") == "ROPE_LLAMA",
                 alibi=opts.get("pos_encoding_mode") == "ALIBI",
                 k_scale=opts.get("k_scale", 1.0), v_scale=opts.get("v_scale", 1.0))
    no, nl = naive_attention(q, k, v, **nopts)
    testing.assert_close(out, no.float(), dtype=torch.float32, atol=1e-5, rtol=1e-4)
    testing.assert_close(lse, nl.float(), dtype=torch.float32, atol=1e-5, rtol=1e-4)


def test_reference_fully_masked_row_and_custom_mask():
    q, k, v = testing.randn((2, 2, 8), seed=1), testing.randn((5, 1, 8), seed=2), testing.randn((5, 1, 8), seed=3)
    mask = torch.tensor([[False] * 5, [True, False, True, False, True]])
    out, lse = attention_reference(q, k, v, custom_mask=mask, return_lse=True)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    no, nl = naive_attention(q, k, v, mask=mask)
    testing.assert_close(out[1], no[1].float(), dtype=torch.float32, atol=1e-5, rtol=1e-4)


def test_alibi_slopes_known_values():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s12 = alibi_slopes(12)  # 8 power-of-two heads, then 4 interleaved ones at 2^(-0.5 - k)
    assert torch.allclose(s12[8:], torch.tensor([2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]))


# ---- paged batch decode on the CPU backend -------------------------------------------------

def make_batch(lens, page_size, hkv, d, dtype=torch.float16, layout="NHD", seed=0, tuple_cache=False):
    pages = [max(1, -(-n // page_size)) for n in lens]
    total = sum(pages) + 3
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[: sum(pages)]
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32)
    shape = (total, 2, page_size, hkv, d) if layout == "NHD" else (total, 2, hkv, page_size, d)
    cache = testing.randn(shape, dtype, seed=seed + 1)
    if tuple_cache:
        cache = (cache[:, 0], cache[:, 1])
    return cache, indptr, perm.to(torch.int32), last


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("tuple_cache", [False, True])
def test_cpu_batch_decode_matches_per_request_reference(layout, tuple_cache):
    lens, ps, hq, hkv, d = [1, 15, 37], 4, 8, 2, 16
    cache, indptr, indices, last = make_batch(lens, ps, hkv, d, layout=layout, tuple_cache=tuple_cache)
    q = testing.randn((3, hq, d), torch.float16, seed=9)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), layout)
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.float16, kv_data_type=torch.float16,
           logits_soft_cap=8.0)
    out, lse = w.run(q, cache, return_lse=True)
    for b in range(3):
        k, v = gather_paged_kv(cache, indptr, indices, last, b, layout)
        assert k.shape[0] == lens[b]
        no, nl = naive_attention(q[b:b + 1].float(), k.float(), v.float(), cap=8.0)
        testing.assert_close(out[b:b + 1], no.to(torch.float16), dtype=torch.float16)
        testing.assert_close(lse[b:b + 1], nl.float(), dtype=torch.float32, atol=1e-4, rtol=1e-4)


def test_cpu_single_decode_matches_naive():
    q = testing.randn((8, 16), torch.bfloat16, seed=1)
    k = testing.randn((11, 2, 16), torch.bfloat16, seed=2)
    v = testing.randn((11, 2, 16), torch.bfloat16, seed=3)
    o, lse = single_decode_with_kv_cache(q, k, v, return_lse=True, window_left=4)
    no, nl = naive_attention(q[None].float(), k.float(), v.float(), window_left=4)
    testing.assert_close(o, no[0].to(torch.bfloat16), dtype=torch.bfloat16)
    o2 = single_decode_with_kv_cache(q, k.transpose(0, 1), v.transpose(0, 1), kv_layout="HND", window_left=4)
    assert torch.equal(o, o2)


# ---- validation ------------------------------------------------------------------------------

def _wrapper():
    return BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD")


def test_int64_indices_rejected():
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    with pytest.raises(InputTypeError, match="int32"):
        _wrapper().plan(indptr, indices.long(), last, 4, 2, 16, 4)
    with pytest.raises(InputTypeError, match="int32"):
        _wrapper().plan(indptr.long(), indices, last, 4, 2, 16, 4)


def test_non_monotone_indptr_rejected():
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    bad = torch.tensor([0, 3, 2], dtype=torch.int32)
    with knobs.override(FI_CHECK_INPUTS="1"):
        with pytest.raises(InputError, match="non-decreasing"):
            _wrapper().plan(bad, indices, last, 4, 2, 16, 4)


def test_pages_past_the_cache_rejected():
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    indices = indices.clone()
    indices[1] = cache.shape[0] + 7
    w = _wrapper()
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16, kv_data_type=torch.float16)
    q = testing.randn((2, 4, 16), torch.float16)
    with knobs.override(FI_CHECK_INPUTS="1"):
        with pytest.raises(InputError, match="page indices"):
            w.run(q, cache)
    # CPU tables are checked without FI_CHECK_INPUTS (their values cost no device read); a
    # negative id would otherwise index the cache from its end
    with pytest.raises(InputError, match=rf"page indices must be in \[0, 8\) \(the cache's page count\), got \[\d+, {cache.shape[0] + 7}\]"):
        w.run(q, cache)
    indices[1] = -1
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16, kv_data_type=torch.float16)
    with pytest.raises(InputError, match=r"got \[-1, "):
        w.run(q, cache)


def test_head_counts_and_head_dim_mismatch_rejected():
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    with pytest.raises(InputError, match="multiple"):
        _wrapper().plan(indptr, indices, last, 5, 2, 16, 4)
    w = _wrapper()
    w.plan(indptr, indices, last, 4, 2, 32, 4, q_data_type=torch.float16, kv_data_type=torch.float16)
    with pytest.raises(InputError, match="head_dim"):
        w.run(testing.randn((2, 4, 32), torch.float16), cache)


def test_bad_last_page_len_and_q_dtype_rejected():
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    with pytest.raises(InputError, match="last_page_len"):
        _wrapper().plan(indptr, indices, torch.tensor([5, 1], dtype=torch.int32), 4, 2, 16, 4)
    w = _wrapper()
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16, kv_data_type=torch.float16)
    with pytest.raises(InputTypeError, match="q must be"):
        w.run(testing.randn((2, 4, 16), torch.bfloat16), cache)
    with pytest.raises(InputError, match="shape"):
        w.run(testing.randn((3, 4, 16), torch.float16), cache)


def test_bad_cache_shapes_rejected():
    w = _wrapper()
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16, kv_data_type=torch.float16)
    q = testing.randn((2, 4, 16), torch.float16)
    with pytest.raises(InputError, match="paged_kv_cache"):
        w.run(q, cache[:, :1])
    with pytest.raises(InputError, match="same shape"):
        w.run(q, (cache[:, 0], cache[:, 1, :2]))
    with pytest.raises(InputError, match="contiguous"):
        w.run(q, (cache[:, 0].transpose(-1, -2), cache[:, 1].transpose(-1, -2)))


@pytest.mark.parametrize("option, value, text", [
    ("sm_scale", float("nan"), "sm_scale must be finite"),
    ("logits_soft_cap", float("inf"), "logits_soft_cap must be finite"),
    ("logits_soft_cap", -2.0, "logits_soft_cap must be None, 0 \\(off\\) or > 0, got -2.0"),
    ("rope_theta", 0.0, "rope_theta must be > 0"),
    ("rope_scale", "2", "rope_scale must be a real number"),
])
def test_float_options_are_checked(option, value, text):
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    with pytest.raises((InputError, InputTypeError), match=text):
        _wrapper().plan(indptr, indices, last, 4, 2, 16, 4, **{option: value})
    k, v = gather_paged_kv(cache, indptr, indices, last, 0)
    with pytest.raises((InputError, InputTypeError), match=text):
        single_decode_with_kv_cache(testing.randn((4, 16), torch.float16), k, v, **{option: value})


@pytest.mark.parametrize("args, kw, err, text", [
    ((4, 2, 16, 4.0), {}, InputError, "page_size must be an int >= 1, got 4.0"),
    ((4.0, 2, 16, 4), {}, InputError, "num_qo_heads must be an int >= 1, got 4.0"),
    ((4, 2, "16", 4), {}, InputError, "head_dim must be an int >= 1, got '16'"),
    ((4, 2, 0, 4), {}, InputError, "head_dim must be an int >= 1, got 0"),
    ((4, 2, 16, 4), {"window_left": 2.5}, InputError, "window_left must be an int >= -1, got 2.5"),
    ((4, 2, 16, 4), {"q_data_type": "int8"}, InputTypeError, "q_data_type must be float16 or bfloat16, got int8"),
    ((4, 2, 16, 4), {"kv_data_type": torch.float32}, InputTypeError, "kv_data_type must be .*float8_e5m2, got float32"),
])
def test_plan_parameters_are_checked(args, kw, err, text):
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    with pytest.raises(err, match=text):
        _wrapper().plan(indptr, indices, last, *args, **kw)


def test_plan_takes_numpy_integers():
    import numpy as np

    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    w = _wrapper()
    w.plan(indptr, indices, last, np.int64(4), np.int32(2), np.int64(16), np.int64(4), q_data_type="fp16")
    q = testing.randn((2, 4, 16), torch.float16)
    assert torch.equal(w.run(q, cache), _wrapper_run(indptr, indices, last, q, cache))


def _wrapper_run(indptr, indices, last, q, cache):
    w = _wrapper()
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16)
    return w.run(q, cache)


def test_run_before_plan_and_bad_layout():
    with pytest.raises(InputError, match="plan"):
        _wrapper().run(torch.zeros(1, 4, 16), torch.zeros(1, 2, 4, 2, 16))
    with pytest.raises(InputError, match="kv_layout"):
        BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), "NDH")


def test_torch_compile_fullgraph_traces_through_run_and_single_decode():
    cache, indptr, indices, last = make_batch([13, 3], 8, 2, 16)
    q = testing.randn((2, 4, 16), torch.float16, seed=2)
    w = _wrapper()
    w.plan(indptr, indices, last, 4, 2, 16, 8, q_data_type=torch.float16)
    f = torch.compile(lambda q, c: w.run(q, c), fullgraph=True, backend="eager")
    assert torch.equal(f(q, cache), w.run(q, cache))
    k, v = gather_paged_kv(cache, indptr, indices, last, 0)
    g = torch.compile(lambda q, k, v: single_decode_with_kv_cache(q, k, v), fullgraph=True, backend="eager")
    assert torch.equal(g(q[0], k, v), single_decode_with_kv_cache(q[0], k, v))


def test_plan_table_validation_fast_and_slow_paths():
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    with pytest.raises(InputError, match="exceeds"):
        _wrapper().plan(indptr, indices[:1], last, 4, 2, 16, 4)
    for bad_last in (0, 5):  # page_size 4: last_page_len must be in [1, 4]
        with pytest.raises(InputError, match="last_page_len must be in"):
            _wrapper().plan(indptr, indices, torch.tensor([bad_last, 1], dtype=torch.int32), 4, 2, 16, 4)
    with pytest.raises(InputError, match="start at 0"):
        _wrapper().plan(torch.tensor([1, 2, 3], dtype=torch.int32), indices, last, 4, 2, 16, 4)
    # a request without pages may carry any last_page_len (the slow path accepts it)
    empty_ok = torch.tensor([0, 0, 3], dtype=torch.int32)
    w = _wrapper()
    w.plan(empty_ok, indices, torch.tensor([0, 2], dtype=torch.int32), 4, 2, 16, 4)
    assert w._batch == 2


def test_tensor_core_variant_per_gpu_and_cache_dtype():
    """sm_90 streams every cache through the shared-memory ring (variant 3), 16-bit caches at 2
    CTAs per SM; other GPUs keep register tiles (0) for 16-bit caches and the ring for fp8 (the
    choices measured faster on the H200); MMA_VARIANT overrides it for A/B runs."""
    import torch  # noqa: PLC0415

    from fi_core import Arch  # noqa: PLC0415
    from fi_attention.decode import spec  # noqa: PLC0415

    def build(kv, arch="9.0a", override=None):
        saved = spec.MMA_VARIANT
        spec.MMA_VARIANT = override
        spec.decode_mma_spec.cache_clear()
        try:
            d = dict(spec.decode_mma_spec(torch.bfloat16, kv, 128, 4, "NONE", False, Arch.parse(arch)).defines)
        finally:
            spec.MMA_VARIANT = saved
            spec.decode_mma_spec.cache_clear()
        return int(d.get("FI_MMA_VARIANT", 0)), int(d.get("FI_MMA_CTAS", 3))

    e4, e5, bf = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    assert build(bf) == (3, spec.RING_16BIT_CTAS) == (3, 2)
    assert build(e4) == build(e5) == (3, 3)
    assert build(bf, "8.0") == build(bf, "8.9") == (0, 3) and build(e4, "8.9") == (3, 3)
    assert build(e4, override=0) == (0, 3) and build(bf, "8.0", override=3) == (3, 2)
    assert build(bf, override=0) == (0, 3)


def test_mma_ab_switches_name_and_define_the_module(monkeypatch):
    """spec.MMA_AB (tools/ab_decode.py) builds another tensor-core module: its own name and a -D
    per switch, which overrides the per-dtype defaults; the default spec is unchanged after."""
    from fi_core import Arch
    from fi_attention.decode import spec

    a = Arch.parse("9.0a")
    e4m3 = torch.float8_e4m3fn
    spec.decode_mma_spec.cache_clear()
    base = spec.decode_mma_spec(torch.bfloat16, e4m3, 128, 4, "NONE", False, a)
    monkeypatch.setattr(spec, "MMA_AB", {"FI_MMA_STAGES": 2, "FI_MMA_VARIANT": 0})
    spec.decode_mma_spec.cache_clear()
    try:
        ab = spec.decode_mma_spec(torch.bfloat16, e4m3, 128, 4, "NONE", False, a)
    finally:
        monkeypatch.undo()
        spec.decode_mma_spec.cache_clear()
    defines = dict(ab.defines)
    assert ab.name == "batch_decode_mma_bf16_e4m3_d128_gh4_p0_c0_mma_stages2_mma_variant0"
    assert ab.key() != base.key() and defines["FI_MMA_STAGES"] == "2" and defines["FI_MMA_VARIANT"] == "0"
    assert base.name.endswith("_mma_variant3") and "FI_MMA_STAGES" not in dict(base.defines)
    assert spec.decode_mma_spec(torch.bfloat16, e4m3, 128, 4, "NONE", False, a).key() == base.key()


def test_workspace_buffer_checks():
    with pytest.raises(InputTypeError, match="float_workspace_buffer must be a torch.Tensor, got list"):
        BatchDecodeWithPagedKVCacheWrapper([0] * 16)
    with pytest.raises(InputError, match=r"float_workspace_buffer must be contiguous, got shape \(32,\) strides \(2,\)"):
        BatchDecodeWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8)[::2])
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8))
    w.reset_workspace_buffer(torch.empty(64, dtype=torch.int32))  # any dtype: used as bytes
    with pytest.raises(InputError, match="must stay on the wrapper's device cpu, got meta"):
        w.reset_workspace_buffer(torch.empty(64, dtype=torch.uint8, device="meta"))


def test_plan_and_run_arguments_are_checked():
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    with pytest.raises(InputError, match=r"indices must be 1-D, got shape \(1, "):
        _wrapper().plan(indptr, indices[None], last, 4, 2, 16, 4)
    with pytest.raises(InputError, match="fixed_split_size must be an int >= 0, got -1"):
        _wrapper().plan(indptr, indices, last, 4, 2, 16, 4, fixed_split_size=-1)
    w = _wrapper()
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16)
    q = testing.randn((2, 4, 16), torch.float16)
    for wl in (-2, 2.7, True, "x"):
        with pytest.raises(InputError, match="window_left must be an int >= -1"):
            w.run(q, cache, window_left=wl)
    with pytest.raises(InputTypeError, match="out must be a torch.Tensor, got list"):
        w.run(q, cache, out=[1, 2])
    with pytest.raises(InputTypeError, match="lse must be a torch.Tensor, got list"):
        w.run(q, cache, lse=[0.0] * 8, return_lse=True)


def test_forward_refuses_options_that_differ_from_the_plan():
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    w = _wrapper()
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16, logits_soft_cap=30.0)
    q = testing.randn((2, 4, 16), torch.float16)
    ref = w.run(q, cache)
    assert torch.equal(w.forward(q, cache), ref)
    assert torch.equal(w.forward(q, cache, pos_encoding_mode="NONE", logits_soft_cap=30.0, sm_scale=0.25), ref)
    assert torch.equal(w.forward(q, cache, window_left=2), w.run(q, cache, window_left=2))
    for kw, text in (({"logits_soft_cap": 1.0}, "logits_soft_cap=1.0 differs from the planned 30.0"),
                     ({"sm_scale": 5.0}, "sm_scale=5.0 differs from the planned 0.25"),
                     ({"rope_theta": 5e5}, "rope_theta=500000.0 differs"),
                     ({"pos_encoding_mode": "ALIBI"}, "pos_encoding_mode='ALIBI' differs")):
        with pytest.raises(InputError, match=text):
            w.forward(q, cache, **kw)
    o, s = w.forward_return_lse(q, cache)
    assert torch.equal(o, ref) and s.shape == (2, 4)


def test_a_strided_head_dim_is_refused_on_cpu_as_on_the_gpu():
    cache, indptr, indices, last = make_batch([5, 9], 4, 2, 16)
    w = _wrapper()
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16)
    q = testing.randn((2, 4, 32), torch.float16)[..., ::2]
    with pytest.raises(InputError, match="q must be contiguous in its last dimension"):
        w.run(q, cache)
    k = testing.randn((9, 2, 32), torch.float16)
    with pytest.raises(InputError, match="k must be contiguous in its last dimension"):
        single_decode_with_kv_cache(testing.randn((4, 16), torch.float16), k[..., ::2], k[..., ::2].contiguous())

"""CPU tests of the prefill API: validation paths, bit packing, and the CPU (reference) backend of
single prefill and both batch wrappers (batch == single per request, paged == ragged)."""

import importlib

import numpy as np
import pytest
import torch

from fi_core.errors import InputError, InputTypeError, UnsupportedError
from fi_core import testing
from fi_attention.prefill import (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
                                  packbits, segment_packbits, single_prefill_with_kv_cache)
from fi_attention.reference import attention_reference

BF16 = torch.bfloat16


def _qkv(lq, lkv, hq=4, hkv=2, d=64, seed=0, dtype=BF16):
    return (testing.randn((lq, hq, d), dtype, seed=seed), testing.randn((lkv, hkv, d), dtype, seed=seed + 1),
            testing.randn((lkv, hkv, d), dtype, seed=seed + 2))


# ---- packbits ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100])
@pytest.mark.parametrize("order", ["big", "little"])
def test_packbits_matches_numpy(n, order):
    x = testing.rand((n,), seed=n) > 0.5
    np.testing.assert_array_equal(packbits(x, order).numpy(), np.packbits(x.numpy(), bitorder=order))


@pytest.mark.parametrize("order", ["big", "little"])
def test_segment_packbits_matches_numpy_per_segment(order):
    lens = [0, 3, 8, 13, 1, 0, 17]
    ind = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    x = testing.rand((int(ind[-1]),), seed=3) > 0.5
    y, new = segment_packbits(x, ind, order)
    for i in range(len(lens)):
        want = np.packbits(x[ind[i]:ind[i + 1]].numpy(), bitorder=order)
        np.testing.assert_array_equal(y[new[i]:new[i + 1]].numpy(), want)
        assert int(new[i + 1] - new[i]) == (lens[i] + 7) // 8


def test_packbits_rejects_bad_input():
    with pytest.raises(InputError, match="bitorder"):
        packbits(torch.ones(3, dtype=torch.bool), "middle")
    with pytest.raises(InputError, match="1-D"):
        packbits(torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(InputError, match="indptr"):
        segment_packbits(torch.ones(4, dtype=torch.bool), torch.tensor([0, 5]))


# ---- validation ---------------------------------------------------------------------------
def test_single_prefill_validation_messages():
    q, k, v = _qkv(5, 9)
    with pytest.raises(InputTypeError, match="q must be float16 or bfloat16, got float32"):
        single_prefill_with_kv_cache(q.float(), k, v)
    with pytest.raises(InputError, match="3-D"):
        single_prefill_with_kv_cache(q[0], k, v)
    with pytest.raises(InputError, match="multiple of num_kv_heads"):
        single_prefill_with_kv_cache(q[:, :3], k, v)
    with pytest.raises(InputError, match="head_dim must match"):
        single_prefill_with_kv_cache(q[..., :32], k, v)
    with pytest.raises(InputError, match="kv_layout"):
        single_prefill_with_kv_cache(q, k, v, kv_layout="HDN")
    with pytest.raises(InputError, match="window_left"):
        single_prefill_with_kv_cache(q, k, v, window_left=-5)
    with pytest.raises(InputError, match="pos_encoding_mode"):
        single_prefill_with_kv_cache(q, k, v, pos_encoding_mode="ROPE")
    with pytest.raises(InputError, match=r"custom_mask must be \[qo_len, kv_len\] = \[5, 9\]"):
        single_prefill_with_kv_cache(q, k, v, custom_mask=torch.ones(5, 8, dtype=torch.bool))
    with pytest.raises(InputError, match="packed_custom_mask needs 6 bytes"):
        single_prefill_with_kv_cache(q, k, v, packed_custom_mask=torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(InputError, match="contiguous"):
        single_prefill_with_kv_cache(q, k.transpose(0, 2).contiguous().transpose(0, 2), v)
    with pytest.raises(UnsupportedError, match="o_dtype"):
        single_prefill_with_kv_cache(q, k, v, o_dtype=torch.float32)
    with pytest.raises(UnsupportedError, match="unknown backend"):
        single_prefill_with_kv_cache(q, k, v, backend="fa9")


def test_wrapper_validation_messages():
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    w = BatchPrefillWithRaggedKVCacheWrapper(ws)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q, k, v = _qkv(5, 9)
    with pytest.raises(InputError, match="plan"):
        w.run(q, k, v)
    with pytest.raises(InputTypeError, match="int32"):
        w.plan(torch.tensor([0, 5]), i32([0, 9]), 4, 2, 64)
    with pytest.raises(InputError, match="non-decreasing"):
        w.plan(i32([0, 5, 3]), i32([0, 9, 9]), 4, 2, 64)
    with pytest.raises(InputError, match="must have 2 entries"):
        w.plan(i32([0, 5]), i32([0, 9, 10]), 4, 2, 64)
    w.plan(i32([0, 5]), i32([0, 9]), 4, 2, 64, q_data_type=BF16)
    with pytest.raises(InputError, match=r"q must be \[qo_indptr\[-1\]"):
        w.run(q[:4], k, v)
    with pytest.raises(InputTypeError, match="k/v dtype"):
        w.run(q, k.half(), v.half())
    p = BatchPrefillWithPagedKVCacheWrapper(ws)
    with pytest.raises(InputError, match="last_page_len"):
        p.plan(i32([0, 5]), i32([0, 1]), i32([0]), i32([17]), 4, 2, 64, 16)
    p.plan(i32([0, 5]), i32([0, 1]), i32([0]), i32([9]), 4, 2, 64, 16, q_data_type=BF16)
    with pytest.raises(InputError, match="page_size"):
        p.run(q, torch.randn(1, 2, 8, 2, 64, dtype=BF16))
    with pytest.raises(InputError, match="use_cuda_graph=True needs"):
        BatchPrefillWithRaggedKVCacheWrapper(ws, use_cuda_graph=True).plan(i32([0, 5]), i32([0, 9]), 4, 2, 64)



def test_cuda_graph_replans_warn_and_plain_wrappers_refuse_capture(monkeypatch, recwarn):
    """run() under a capture: a wrapper without use_cuda_graph raises; a CUDA-graph wrapper records
    what the graph keeps, and a later plan() with other options warns (the same options do not).
    The capture test is simulated (this machine has no GPU); the fa3 query-block bound is
    checked on the GPU (test_prefill_gpu.py)."""
    from fi_attention.prefill import wrappers  # noqa: PLC0415

    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    q, k, v = _qkv(5, 9)
    plain = BatchPrefillWithRaggedKVCacheWrapper(ws)
    plain.plan(i32([0, 5]), i32([0, 9]), 4, 2, 64, q_data_type=BF16)
    graph = BatchPrefillWithRaggedKVCacheWrapper(ws, use_cuda_graph=True, qo_indptr_buf=i32([0, 0]),
                                                 kv_indptr_buf=i32([0, 0]))
    graph.plan(i32([0, 5]), i32([0, 9]), 4, 2, 64, q_data_type=BF16)
    graph.run(q, k, v)  # not captured: nothing recorded
    graph.plan(i32([0, 5]), i32([0, 9]), 4, 2, 64, q_data_type=BF16, causal=True)
    assert not [w for w in recwarn if "CUDA-graph prefill" in str(w.message)]
    monkeypatch.setattr(wrappers, "is_capturing", lambda: True)
    with pytest.raises(InputError, match="use_cuda_graph=False"):
        plain.run(q, k, v)
    graph.run(q, k, v)  # captured with causal=True
    monkeypatch.setattr(wrappers, "is_capturing", lambda: False)
    graph.plan(i32([0, 5]), i32([0, 9]), 4, 2, 64, q_data_type=BF16, causal=True)
    assert not [w for w in recwarn if "CUDA-graph prefill" in str(w.message)]
    with pytest.warns(UserWarning, match="re-planned with other options"):
        graph.plan(i32([0, 5]), i32([0, 9]), 4, 2, 64, q_data_type=BF16, causal=False)
    with pytest.warns(UserWarning, match="re-planned with other options"):
        graph.plan(i32([0, 5]), i32([0, 9]), 4, 2, 64, q_data_type=BF16, causal=True, window_left=3)
    testing.assert_close(plain.run(q, k, v), attention_reference(q, k, v), dtype=BF16)


# ---- CPU backend ----------------------------------------------------------------------------
def test_single_prefill_cpu_is_the_reference_with_masks_packed_or_dense():
    q, k, v = _qkv(6, 11)
    mask = testing.rand((6, 11), seed=5) > 0.3
    want, wl = attention_reference(q, k, v, custom_mask=mask, return_lse=True)
    o1, l1 = single_prefill_with_kv_cache(q, k, v, custom_mask=mask, return_lse=True, causal=True)
    o2, l2 = single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packbits(mask.flatten(), "little"),
                                          return_lse=True)
    for o, lse in ((o1, l1), (o2, l2)):
        torch.testing.assert_close(o, want, rtol=0, atol=0)
        torch.testing.assert_close(lse, wl, rtol=0, atol=0)


def test_single_prefill_cpu_hnd_matches_nhd():
    q, k, v = _qkv(4, 13)
    a = single_prefill_with_kv_cache(q, k, v, causal=True)
    b = single_prefill_with_kv_cache(q, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(),
                                     causal=True, kv_layout="HND")
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _batch(qo_lens, kv_lens, hq=4, hkv=2, d=64, seed=0):
    qo_ind = torch.tensor(np.concatenate([[0], np.cumsum(qo_lens)]), dtype=torch.int32)
    kv_ind = torch.tensor(np.concatenate([[0], np.cumsum(kv_lens)]), dtype=torch.int32)
    q = testing.randn((int(qo_ind[-1]), hq, d), BF16, seed=seed)
    k = testing.randn((int(kv_ind[-1]), hkv, d), BF16, seed=seed + 1)
    v = testing.randn((int(kv_ind[-1]), hkv, d), BF16, seed=seed + 2)
    return qo_ind, kv_ind, q, k, v


def _paged_from_ragged(kv_lens, k, v, page_size, seed=0):
    """Scatter ragged k/v into a shuffled paged cache [P, 2, ps, H, D]; returns indices too."""
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages) + 3
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:sum(pages)].to(torch.int32)
    cache = testing.randn((total, 2, page_size, k.shape[1], k.shape[2]), k.dtype, seed=seed + 9)
    pos, ptr = 0, 0
    for n, np_ in zip(kv_lens, pages):
        for i in range(np_):
            m = min(page_size, n - i * page_size)
            cache[perm[ptr + i], 0, :m] = k[pos + i * page_size: pos + i * page_size + m]
            cache[perm[ptr + i], 1, :m] = v[pos + i * page_size: pos + i * page_size + m]
        pos += n
        ptr += np_
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 1 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return cache, indptr, perm, last


def test_batch_cpu_equals_single_per_request_and_paged_equals_ragged():
    qo_lens, kv_lens = [3, 0, 7, 1], [9, 4, 7, 20]
    qo_ind, kv_ind, q, k, v = _batch(qo_lens, kv_lens)
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    w = BatchPrefillWithRaggedKVCacheWrapper(ws)
    w.plan(qo_ind, kv_ind, 4, 2, 64, causal=True, q_data_type=BF16)
    out, lse = w.run(q, k, v, return_lse=True)
    for b in range(len(qo_lens)):
        a, e, c, f = int(qo_ind[b]), int(qo_ind[b + 1]), int(kv_ind[b]), int(kv_ind[b + 1])
        if a == e:
            continue
        o1, l1 = single_prefill_with_kv_cache(q[a:e], k[c:f], v[c:f], causal=True, return_lse=True)
        torch.testing.assert_close(out[a:e], o1, rtol=0, atol=0)
        torch.testing.assert_close(lse[a:e], l1, rtol=0, atol=0)
    cache, indptr, indices, last = _paged_from_ridged = _paged_from_ragged(kv_lens, k, v, 4)
    p = BatchPrefillWithPagedKVCacheWrapper(ws)
    p.plan(qo_ind, indptr, indices, last, 4, 2, 64, 4, causal=True, q_data_type=BF16)
    out2, lse2 = p.run(q, cache, return_lse=True)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(lse2, lse, rtol=0, atol=0)
    # tuple cache in HND layout gives the same result
    ph = BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="HND")
    ph.plan(qo_ind, indptr, indices, last, 4, 2, 64, 4, causal=True, q_data_type=BF16)
    kc, vc = cache[:, 0].transpose(1, 2).contiguous(), cache[:, 1].transpose(1, 2).contiguous()
    torch.testing.assert_close(ph.run(q, (kc, vc)), out, rtol=0, atol=0)
    # destinations on another device than q are refused before any launch
    with pytest.raises(InputError, match="on cpu"):
        w.run(q, k, v, out=torch.empty(out.shape, dtype=out.dtype, device="meta"))
    with pytest.raises(InputError, match="on cpu"):
        w.run(q, k, v, lse=torch.empty(lse.shape, dtype=torch.float32, device="meta"))


def test_batch_custom_mask_cpu_matches_reference():
    qo_lens, kv_lens = [3, 5], [6, 5]
    qo_ind, kv_ind, q, k, v = _batch(qo_lens, kv_lens)
    masks = [testing.rand((a, b), seed=i) > 0.4 for i, (a, b) in enumerate(zip(qo_lens, kv_lens))]
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(qo_ind, kv_ind, 4, 2, 64, custom_mask=torch.cat([m.flatten() for m in masks]), q_data_type=BF16)
    out = w.run(q, k, v)
    torch.testing.assert_close(out[:3], attention_reference(q[:3], k[:6], v[:6], custom_mask=masks[0]), rtol=0, atol=0)
    torch.testing.assert_close(out[3:], attention_reference(q[3:], k[6:], v[6:], custom_mask=masks[1]), rtol=0, atol=0)


def test_bench_module_registers_routines():
    bench = importlib.import_module("fi_attention.bench_prefill")
    from fi_core.bench import ROUTINES
    for name in ("single_prefill", "BatchPrefillWithRaggedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
        assert name in ROUTINES, name
    assert bench is not None


def test_single_prefill_traces_with_torch_compile_fullgraph():
    q, k, v = _qkv(5, 9)

    def f(q, k, v):
        return single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)

    out, lse = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    want, wl = attention_reference(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, wl, rtol=0, atol=0)


def test_scales_must_be_finite_numbers():
    q = torch.randn(4, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(6, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="scale_k must be finite, got nan"):
        single_prefill_with_kv_cache(q, k, k, scale_k=float("nan"))
    with pytest.raises(InputError, match="scale_v must be finite, got inf"):
        single_prefill_with_kv_cache(q, k, k, scale_v=torch.tensor(float("inf")))
    with pytest.raises(InputTypeError, match="scale_q must be a real number, got str"):
        single_prefill_with_kv_cache(q, k, k, scale_q="2")


@pytest.mark.parametrize("option, value, text", [
    ("sm_scale", float("nan"), "sm_scale must be finite"),
    ("logits_soft_cap", float("inf"), "logits_soft_cap must be finite"),
    ("logits_soft_cap", -2.0, "logits_soft_cap must be None, 0 \\(off\\) or > 0, got -2.0"),
    ("rope_theta", -1.0, "rope_theta must be > 0"),
    ("rope_scale", "2", "rope_scale must be a real number"),
])
def test_float_options_are_checked(option, value, text):
    q = torch.randn(4, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(6, 2, 64, dtype=torch.bfloat16)
    with pytest.raises((InputError, InputTypeError), match=text):
        single_prefill_with_kv_cache(q, k, k, **{option: value})
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    indptr = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises((InputError, InputTypeError), match=text):
        w.plan(indptr, torch.tensor([0, 6], dtype=torch.int32), 4, 2, 64, **{option: value})


@pytest.mark.parametrize("args, kw, err, text", [
    ((4, 2, 64, 16.0), {}, InputError, "page_size must be an int >= 1, got 16.0"),
    ((4.0, 2, 64, 16), {}, InputError, "num_qo_heads must be an int >= 1, got 4.0"),
    ((4, 2, 0, 16), {}, InputError, "head_dim_qk must be an int >= 1, got 0"),
    ((4, 2, 64, 16), {"head_dim_vo": -1}, InputError, "head_dim_vo must be an int >= 1, got -1"),
    ((4, 2, 64, 16), {"q_data_type": "int8"}, InputTypeError, "q_data_type must be float16 or bfloat16, got int8"),
    ((4, 2, 64, 16), {"kv_data_type": torch.float32}, InputTypeError, "kv_data_type must be .*float8_e5m2, got float32"),
])
def test_paged_plan_parameters_are_checked(args, kw, err, text):
    i32 = dict(dtype=torch.int32)
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(err, match=text):
        w.plan(torch.tensor([0, 3, 5], **i32), torch.tensor([0, 1, 3], **i32), torch.tensor([0, 1, 2], **i32),
               torch.tensor([4, 16], **i32), *args, **kw)


def test_workspace_buffer_checks():
    with pytest.raises(InputError, match=r"float_workspace_buffer must be 1-D, got shape \(8, 8\)"):
        BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8, 8, dtype=torch.uint8))
    with pytest.raises(InputError, match="float_workspace_buffer must be contiguous"):
        BatchPrefillWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8)[::2])
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(64, dtype=torch.uint8))
    with pytest.raises(InputError, match="must stay on the wrapper's device cpu, got meta"):
        w.reset_workspace_buffer(torch.empty(64, dtype=torch.uint8, device="meta"))


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def test_a_failed_replan_leaves_the_wrapper_unplanned():
    """A plan() that raised must not leave half its tables behind for run() to use."""
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(_i32([0, 2, 5]), _i32([0, 4, 9]), 4, 2, 64, q_data_type=torch.float16)
    q = torch.randn(5, 4, 64, dtype=torch.float16)
    k, v = torch.randn(9, 2, 64, dtype=torch.float16), torch.randn(9, 2, 64, dtype=torch.float16)
    w.run(q, k, v)
    with pytest.raises(InputError, match="pos_encoding_mode"):
        w.plan(_i32([0, 2, 5]), _i32([0, 1, 2]), 4, 2, 64, q_data_type=torch.float16, pos_encoding_mode="bad")
    with pytest.raises(InputError, match="a plan\\(\\) that raised leaves the wrapper unplanned"):
        w.run(q, k, v)
    p = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(InputError, match="window_left"):
        p.plan(_i32([0, 3]), _i32([0, 1]), _i32([0]), _i32([3]), 4, 2, 64, 4, window_left=-5)
    with pytest.raises(InputError, match="call plan\\(\\) before run\\(\\)"):
        p.run(torch.randn(3, 4, 64, dtype=torch.float16), torch.randn(2, 2, 4, 2, 64, dtype=torch.float16))


@pytest.mark.parametrize("change, err, text", [
    ({"paged_kv_indices": _i32([[0, 1]])}, InputError, r"paged_kv_indices must be 1-D, got shape \(1, 2\)"),
    ({"paged_kv_indices": torch.tensor([0.0, 1.0])}, InputTypeError, "paged_kv_indices must be int32, got float32"),
    ({"paged_kv_last_page_len": _i32([5, 1])}, InputError,
     r"paged_kv_last_page_len must be in \[1, page_size=4\]; request 0 has 5"),
    ({"paged_kv_last_page_len": _i32([[4, 1]])}, InputError, r"paged_kv_last_page_len must be 1-D"),
    ({"paged_kv_last_page_len": None}, InputTypeError, "paged_kv_last_page_len must be a torch.Tensor"),
    ({"head_dim_vo": 32}, InputError, "head_dim_vo must be None or head_dim_qk = 64, got 32"),
    ({"custom_mask": torch.zeros(2 * 4 + 1 * 1)}, InputTypeError, "custom_mask must be bool, got float32"),
    ({"packed_custom_mask": torch.ones(1, dtype=torch.uint8)}, InputError,
     "packed_custom_mask must hold sum.* = 2 bytes, got 1"),
])
def test_paged_plan_tables_and_masks_are_checked(change, err, text):
    kw = dict(qo_indptr=_i32([0, 2, 3]), paged_kv_indptr=_i32([0, 1, 2]), paged_kv_indices=_i32([0, 1]),
              paged_kv_last_page_len=_i32([4, 1]), num_qo_heads=4, num_kv_heads=2, head_dim_qk=64, page_size=4)
    kw.update(change)
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(err, match=text):
        w.plan(**kw)


def test_paged_run_checks_the_page_ids_against_the_cache():
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    cache = torch.randn(4, 2, 4, 2, 64, dtype=torch.float16)
    q = torch.randn(3, 4, 64, dtype=torch.float16)
    for ids, text in (([0, -1], r"\[-1, 0\]"), ([0, 4], r"\[0, 4\]")):
        w.plan(_i32([0, 2, 3]), _i32([0, 1, 2]), _i32(ids), _i32([4, 1]), 4, 2, 64, 4, q_data_type=torch.float16)
        with pytest.raises(InputError, match=r"paged_kv_indices must be in \[0, 4\) \(the cache's page count\), got "
                                             + text):
            w.run(q, cache)


def test_forward_refuses_options_that_differ_from_the_plan():
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(_i32([0, 2, 5]), _i32([0, 4, 9]), 4, 2, 64, causal=True, q_data_type=torch.float16)
    q = torch.randn(5, 4, 64, dtype=torch.float16)
    k, v = torch.randn(9, 2, 64, dtype=torch.float16), torch.randn(9, 2, 64, dtype=torch.float16)
    ref = w.run(q, k, v)
    assert torch.equal(w.forward(q, k, v), ref)
    assert torch.equal(w.forward(q, k, v, causal=True, sm_scale=1 / 8.0, logits_soft_cap=0.0), ref)
    for kw, text in (({"causal": False}, "causal=False differs from the planned True"),
                     ({"logits_soft_cap": 1.0}, "logits_soft_cap=1.0 differs from the planned 0.0"),
                     ({"sm_scale": 5.0}, "sm_scale=5.0 differs"),
                     ({"pos_encoding_mode": "ROPE_LLAMA"}, "pos_encoding_mode='ROPE_LLAMA' differs")):
        with pytest.raises(InputError, match=text):
            w.forward(q, k, v, **kw)
    with pytest.raises(InputError, match="causal=False differs"):
        w.forward_return_lse(q, k, v, causal=False)


def test_run_arguments_are_checked():
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(_i32([0, 2]), _i32([0, 3]), 4, 2, 64, q_data_type=torch.float16)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    k = torch.randn(3, 2, 64, dtype=torch.float16)
    with pytest.raises(InputTypeError, match="lse must be a torch.Tensor, got list"):
        w.run(q, k, k, lse=[0.0], return_lse=True)
    with pytest.raises(InputError, match="enable_pdl must be None or a bool, got 'x'"):
        w.run(q, k, k, enable_pdl="x")
    with pytest.raises(InputTypeError, match="q dtype bfloat16 differs from plan"):
        w.run(q.bfloat16(), k, k)
    with pytest.raises(InputTypeError, match="k/v dtype must be float16"):
        w.run(q, k.bfloat16(), k.bfloat16())


def test_single_prefill_masks_and_head_dim_are_checked():
    q, k = torch.randn(5, 4, 64, dtype=torch.float16), torch.randn(9, 2, 64, dtype=torch.float16)
    with pytest.raises(InputTypeError, match="custom_mask must be bool, got float32"):
        single_prefill_with_kv_cache(q, k, k, custom_mask=torch.zeros(5, 9))
    z = torch.randn(5, 4, 0, dtype=torch.float16)
    with pytest.raises(InputError, match="head_dim must be >= 1"):
        single_prefill_with_kv_cache(z, torch.randn(9, 2, 0, dtype=torch.float16), torch.randn(9, 2, 0, dtype=torch.float16))
    assert single_prefill_with_kv_cache(q, k, k, o_dtype="float16").dtype == torch.float16

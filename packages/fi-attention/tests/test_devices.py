"""Inputs on another device than the call's other tensors raise InputError before any launch.

A kernel handed a host pointer faults with an illegal address and takes the process's CUDA
context with it, so every op compares devices first. On a GPU the stray tensor is a CPU one next
to CUDA tensors; without a GPU it is a meta tensor next to CPU ones (the same checks, no data).
The GPU cases also check that the context is still usable afterwards.
"""

import pytest
import torch

from fi_core import testing
from fi_core.errors import InputError
from fi_attention import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                          BatchPrefillWithRaggedKVCacheWrapper, append_paged_kv_cache,
                          get_batch_indices_positions, get_seq_lens, merge_state, merge_state_in_place,
                          merge_states, single_decode_with_kv_cache)

BF16 = torch.bfloat16
HQ, HKV, D, PS = 4, 2, 64, 16

# (device of the call, device of the stray tensor)
DEVICES = pytest.mark.parametrize("dev,other", [
    pytest.param("cpu", "meta", id="cpu-meta"),
    pytest.param("cuda", "cpu", id="cuda-cpu", marks=testing.gpu_only()),
])


@pytest.fixture(autouse=True)
def _context_survives(request):
    yield
    if "cuda" in request.node.name and testing.has_cuda():
        torch.cuda.synchronize()  # raises if a kernel faulted
        assert torch.ones(2, device="cuda").sum().item() == 2


def _paged(dev, pages=4):
    """A 2-request page table (20 and 13 tokens) and an NHD cache of `pages` pages."""
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=dev)
    indices = torch.tensor([2, 0, 3], dtype=torch.int32, device=dev)
    last = torch.tensor([4, 13], dtype=torch.int32, device=dev)
    cache = testing.randn((pages, 2, PS, HKV, D), BF16, device=dev, seed=1)
    return indptr, indices, last, cache


def _workspace(dev):
    return torch.empty(16 << 20, dtype=torch.uint8, device=dev)


@DEVICES
def test_single_decode(dev, other):
    q = testing.randn((HQ, D), BF16, device=dev)
    k = testing.randn((9, HKV, D), BF16, device=dev, seed=1)
    for kk, vv in ((k.to(other), k), (k, k.to(other))):
        with pytest.raises(InputError, match="one device"):
            single_decode_with_kv_cache(q, kk, vv)


@DEVICES
def test_batch_decode(dev, other):
    indptr, indices, last, cache = _paged(dev)
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace(dev))
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    q = testing.randn((2, HQ, D), BF16, device=dev)
    with pytest.raises(InputError, match="q is on"):
        w.run(q.to(other), cache)
    with pytest.raises(InputError, match="paged_kv_cache is on"):
        w.run(q, cache.to(other))
    with pytest.raises(InputError, match="paged_kv_cache is on"):
        w.run(q, (cache[:, 0].to(other), cache[:, 1].to(other)))
    out = w.run(q, cache)  # the wrapper still works (on a GPU the repeat call takes the launch path)
    testing.assert_close(w.run(q, cache), out, atol=0, rtol=0)
    with pytest.raises(InputError, match="q is on"):
        w.run(q.to(other), cache)


@DEVICES
def test_prefill_ragged(dev, other):
    qo = torch.tensor([0, 3, 8], dtype=torch.int32)
    kv = torch.tensor([0, 10, 17], dtype=torch.int32)
    w = BatchPrefillWithRaggedKVCacheWrapper(_workspace(dev))
    w.plan(qo, kv, HQ, HKV, D, causal=True, q_data_type=BF16)
    q = testing.randn((8, HQ, D), BF16, device=dev)
    k = testing.randn((17, HKV, D), BF16, device=dev, seed=1)
    with pytest.raises(InputError, match="k and v must be on q's device"):
        w.run(q, k.to(other), k)
    with pytest.raises(InputError, match="k and v must be on q's device"):
        w.run(q, k, k.to(other))
    w.run(q, k, k)


@DEVICES
def test_prefill_paged(dev, other):
    indptr, indices, last, cache = _paged(dev)
    w = BatchPrefillWithPagedKVCacheWrapper(_workspace(dev))
    w.plan(torch.tensor([0, 3, 8], dtype=torch.int32), indptr, indices, last, HQ, HKV, D, PS, causal=True,
           q_data_type=BF16)
    q = testing.randn((8, HQ, D), BF16, device=dev)
    with pytest.raises(InputError, match="paged_kv_cache must be on q's device"):
        w.run(q, cache.to(other))
    w.run(q, cache)


@DEVICES
def test_append(dev, other):
    indptr, indices, last, cache = _paged(dev)
    key = testing.randn((3, HKV, D), BF16, device=dev, seed=2)
    bi = torch.tensor([0, 0, 1], dtype=torch.int32, device=dev)
    pos = torch.tensor([18, 19, 12], dtype=torch.int32, device=dev)
    args = [key, key.clone(), bi, pos, cache, indices, indptr, last]
    for i in range(len(args)):
        bad = list(args)
        bad[i] = bad[i].to(other)
        with pytest.raises(InputError, match="one device"):
            append_paged_kv_cache(*bad)
    append_paged_kv_cache(*args)
    with pytest.raises(InputError, match="one device"):
        get_seq_lens(indptr, last.to(other), PS)
    with pytest.raises(InputError, match="one device"):
        get_batch_indices_positions(indptr.to(other), last, 3)


@DEVICES
def test_merge(dev, other):
    v = testing.randn((5, HQ, D), BF16, device=dev)
    s = testing.randn((5, HQ), torch.float32, device=dev, seed=1)
    with pytest.raises(InputError, match="s_a must be on v_a's device"):
        merge_state(v, s.to(other), v, s)
    with pytest.raises(InputError, match="v_a and v_b must match"):
        merge_state(v, s, v.to(other), s.to(other))
    with pytest.raises(InputError, match="v and v_other must match"):
        merge_state_in_place(v.clone(), s.clone(), v.to(other), s.to(other))
    with pytest.raises(InputError, match="mask must be"):
        merge_state_in_place(v.clone(), s.clone(), v, s, torch.ones(5, dtype=torch.bool, device=other))
    with pytest.raises(InputError, match="s must be on v's device"):
        merge_states(v.view(5, 1, HQ, D), s.view(5, 1, HQ).to(other))
    merge_state_in_place(v.clone(), s.clone(), v, s, torch.ones(5, dtype=torch.bool, device=dev))


def test_batch_decode_failed_plan_leaves_it_unplanned():
    """A plan() that raises must not leave the previous plan in force (the README's contract):
    run() then refuses. The launch path's side (a wrapper whose repeat calls skip the checks) is
    test_decode_hostpath.py::test_cuda_graph_replan_keeps_every_address."""
    indptr, indices, last, cache = _paged("cpu")
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"))
    q = testing.randn((2, HQ, D), BF16)
    for bad in (dict(last_page_len=torch.tensor([4, PS + 1], dtype=torch.int32)), dict(window_left=-4)):
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        w.run(q, cache)
        kw = dict(indptr=indptr, indices=indices, last_page_len=last, window_left=-1) | bad
        with pytest.raises(InputError):
            w.plan(kw["indptr"], kw["indices"], kw["last_page_len"], HQ, HKV, D, PS, q_data_type=BF16,
                   window_left=kw["window_left"])
        with pytest.raises(InputError, match="before plan"):
            w.run(q, cache)

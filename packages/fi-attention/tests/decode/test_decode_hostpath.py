"""CPU tests of BatchDecodeWithPagedKVCacheWrapper's CUDA host path (plan() staging, run()'s launch
path and its fallback to the checked path), run under fi_attention.decode.hostsim: the same Python
as on a GPU, with the launcher recording the argument block it is given."""

import ctypes
import math

import numpy as np
import pytest
import torch

from fi_core import knobs
from fi_core.errors import CudaError, InputError, InputTypeError
from fi_attention import BatchDecodeWithPagedKVCacheWrapper
from fi_attention.decode.hostsim import FAKE_STREAM, SM_COUNT, CTAS_PER_SM, HostSim
from fi_attention.decode import launch
from fi_attention.decode.launch import DecodeArgs
from fi_attention.decode.planner import kv_lengths, plan_decode
from fi_attention.decode.tables import host_i32, host_tables, request_lengths

PS, HQ, HKV, D = 16, 32, 8, 128
BF16 = torch.bfloat16


def tables(lens, ps=PS, seed=0):
    """Shuffled page table for requests of the given token counts (0: no pages)."""
    pages = [-(-n // ps) for n in lens]
    perm = torch.randperm(sum(pages) + 3, generator=torch.Generator().manual_seed(seed))[: sum(pages)]
    indptr = torch.tensor([0] + np.cumsum(pages).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * ps if p else 0 for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr, perm.to(torch.int32), last


def cache_for(indices, ps=PS, dtype=BF16):
    n = int(indices.max()) + 1 if indices.numel() else 1
    return torch.zeros(n, 2, ps, HKV, D, dtype=dtype)


def args_bytes(args: DecodeArgs) -> bytes:
    return ctypes.string_at(ctypes.addressof(args), ctypes.sizeof(DecodeArgs))


def ints(buf: torch.Tensor, addr: int, n: int) -> list:
    off = (addr - buf.data_ptr()) // 4
    return buf[off: off + n].tolist()


@pytest.fixture
def sim():
    with HostSim() as s:
        yield s


@pytest.mark.parametrize("lens", [[600], [4096] * 3, [1, 5000, 0, 300, 17], [0, 0], [20000, 16]])
def test_plan_stages_the_plan_and_the_page_table_in_one_buffer(sim, lens):
    indptr, indices, last = tables(lens)
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, logits_soft_cap=30.0, rope_theta=5e5)
    q = torch.zeros(len(lens), HQ, D, dtype=BF16)
    w.run(q, cache_for(indices), out=torch.empty_like(q))
    a, stream = sim.launches[-1]
    want = plan_decode(kv_lengths(indptr.numpy(), last.numpy(), PS), kv_units=HKV,
                       sm_count=SM_COUNT, ctas_per_sm=CTAS_PER_SM)
    buf = w._staging.device_buf
    n, B = want.num_items, len(lens)
    assert stream == FAKE_STREAM and a.grid_items == n
    assert ints(buf, a.work, 4 * n) == want.work.reshape(-1).tolist()
    assert ints(buf, a.num_work, 1) == [n]
    assert ints(buf, a.merge_indptr, B + 1) == want.merge_indptr.tolist()
    assert ints(buf, a.kv_indptr, B + 1) == indptr.tolist()
    assert ints(buf, a.kv_last_page_len, B) == last.tolist()
    assert ints(buf, a.kv_indices, int(indptr[-1])) == indices.tolist()
    assert a.merge_batch == (B if want.split else 0)
    assert (a.num_qo_heads, a.num_kv_heads, a.page_size, a.page_shift) == (HQ, HKV, PS, 4)
    assert a.part_o == w._float_ws.data_ptr()
    assert a.part_lse == a.part_o + want.num_slots * HQ * D * 4
    assert (a.logits_soft_cap, a.rope_scale, a.rope_theta) == (30.0, 1.0, 5e5)
    assert (a.window_left, a.sm_scale, a.k_scale, a.v_scale, a.lse) == (-1, 1 / math.sqrt(D), 1.0, 1.0, 0)


def test_launch_path_and_checked_path_write_the_same_arguments(sim):
    indptr, indices, last = tables([3000, 40])
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, window_left=100)
    cache = cache_for(indices)
    q = torch.zeros(2, 2, HQ, D, dtype=BF16)[:, 1]  # a view: batch stride 2 * HQ * D
    out = torch.empty(2, HQ, D, dtype=BF16)
    w.run(q, cache, out=out, k_scale=0.5, v_scale=2.0)  # first sight of the cache: checked path
    w.run(q, cache, out=out, k_scale=0.5, v_scale=2.0)  # remembered cache: launch path
    with knobs.override(FI_CHECK_INPUTS="1"):  # forces the checked path
        w.run(q, cache, out=out, k_scale=0.5, v_scale=2.0)
    checked, fast, checked2 = (args_bytes(a) for a, _ in sim.launches)
    assert fast == checked == checked2
    a = sim.launches[-1][0]
    assert (a.q, a.q_stride_b, a.q_stride_h) == (q.data_ptr(), 2 * HQ * D, D)
    assert (a.out, a.o_stride_b, a.o_stride_h) == (out.data_ptr(), HQ * D, D)
    assert (a.k, a.v) == (cache.data_ptr(), cache[:, 1].data_ptr())
    assert (a.k_stride_page, a.k_stride_tok, a.k_stride_head) == (2 * PS * HKV * D, HKV * D, D)
    assert (a.window_left, a.k_scale, a.v_scale) == (100, 0.5, 2.0)


def test_per_call_options_reach_the_arguments_and_do_not_stick(sim):
    indptr, indices, last = tables([700, 64])
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, sm_scale=0.25)
    cache = cache_for(indices)
    q = torch.zeros(2, HQ, D, dtype=BF16)
    lse = torch.empty(2, HQ)
    w.run(q, cache, q_scale=2.0, window_left=31, lse=lse, k_scale=torch.tensor(0.5))
    a = sim.launches[-1][0]
    assert (a.sm_scale, a.window_left, a.lse, a.k_scale) == (0.5, 31, lse.data_ptr(), 0.5)
    o, l2 = w.run(q, cache, return_lse=True)
    a = sim.launches[-1][0]
    assert a.lse == l2.data_ptr() and a.out == o.data_ptr() and o.is_contiguous()
    w.run(q, cache)  # defaults again, on the launch path
    a = sim.launches[-1][0]
    assert (a.sm_scale, a.window_left, a.lse, a.k_scale, a.v_scale) == (0.25, -1, 0, 1.0, 1.0)


def test_switching_caches_rewrites_the_kv_fields(sim):
    indptr, indices, last = tables([300, 40])
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    a_cache, b_cache = cache_for(indices), cache_for(indices)
    pair = (b_cache[:, 0], b_cache[:, 1])
    q = torch.zeros(2, HQ, D, dtype=BF16)
    for c in (a_cache, a_cache, b_cache, a_cache, pair, pair, a_cache):
        w.run(q, c)
    # the launch path skips the repacking for the previous call's cache: a checked call (return_lse)
    # with another cache in between must not leave it thinking the block still holds the first
    for c, lse in ((a_cache, False), (b_cache, True), (a_cache, False), (a_cache, True), (b_cache, False)):
        w.run(q, c, return_lse=lse)
    got = [(a.k, a.v) for a, _ in sim.launches]
    ka, kb = (a_cache.data_ptr(), a_cache[:, 1].data_ptr()), (b_cache.data_ptr(), b_cache[:, 1].data_ptr())
    assert got == [ka, ka, kb, ka, kb, kb, ka, ka, kb, ka, ka, kb]


def test_cache_strides_past_32_bits_are_refused(sim):
    # the kernels compute row offsets with 32-bit page and token strides
    indptr, indices, last = tables([10])
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    base = torch.zeros(PS * HKV * D, dtype=BF16)
    k = base.as_strided((1, PS, HKV, D), (1 << 31, HKV * D, D, 1))  # one page: in bounds
    v = base.as_strided((1, PS, HKV, D), (PS * HKV * D, HKV * D, D, 1))
    with pytest.raises(InputError, match="below 2\\^31 elements"):
        w.run(torch.zeros(1, HQ, D, dtype=BF16), (k, v))
    assert not sim.launches
    w.run(torch.zeros(1, HQ, D, dtype=BF16), (v, v))
    assert len(sim.launches) == 1


def test_launch_path_declines_and_the_checked_path_raises(sim):
    indptr, indices, last = tables([300, 40])
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    cache = cache_for(indices)
    q = torch.zeros(2, HQ, D, dtype=BF16)
    w.run(q, cache)  # the cache is remembered: later calls reach the launch path's checks
    with pytest.raises(InputTypeError, match="q must be"):
        w.run(q.half(), cache)
    with pytest.raises(InputError, match="q must have shape"):
        w.run(torch.zeros(3, HQ, D, dtype=BF16), cache)
    with pytest.raises(InputError, match="16-byte aligned"):
        w.run(torch.zeros(2 * HQ * D + 1, dtype=BF16)[1:].view(2, HQ, D), cache)
    with pytest.raises(InputError, match="out must be"):
        w.run(q, cache, out=torch.empty(2, HQ, D))
    with pytest.raises(InputError, match="out must be"):
        w.run(q, cache, out=torch.empty(2, HQ, 2 * D, dtype=BF16)[:, :, ::2])
    with pytest.raises(InputError, match="paged_kv_cache has"):
        w.run(q, cache[:, :, :, :4])
    with pytest.raises(InputTypeError, match="paged_kv_cache must be"):
        w.run(q, cache.view(torch.float16))
    launches = len(sim.launches)
    for bad in (float("nan"), float("inf")):  # a float, so the launch path's type test passes
        with pytest.raises(InputError, match="k_scale must be finite"):
            w.run(q, cache, k_scale=bad)
        with pytest.raises(InputError, match="v_scale must be finite"):
            w.run(q, cache, v_scale=bad)
    with pytest.raises(InputTypeError, match="k_scale must be a real number, got str"):
        w.run(q, cache, k_scale="0.5")
    assert len(sim.launches) == launches
    sim.capturing = True  # the launcher refuses (REFUSE_CAPTURE), the checked path asks torch
    launches = len(sim.launches)
    for kw in ({}, {"return_lse": True}):
        with pytest.raises(InputError, match="use_cuda_graph"):
            w.run(q, cache, **kw)
    assert len(sim.launches) == launches
    sim.capturing = False
    launches = len(sim.launches)
    sim.return_code = 700
    with pytest.raises(CudaError, match="fi_batch_decode"):
        w.run(q, cache)
    assert len(sim.launches) == launches + 1


def test_a_failed_plan_leaves_no_runnable_state(sim):
    indptr, indices, last = tables([20000, 20000])
    w = sim.wrapper(workspace_bytes=1 << 16)  # too small for the split plan's partial states
    with pytest.raises(InputError, match="float_workspace_buffer"):
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    with pytest.raises(InputError, match="before plan"):
        w.run(torch.zeros(2, HQ, D, dtype=BF16), cache_for(indices))
    assert not sim.launches


def test_metadata_ring_waits_only_when_it_wraps(sim):
    indptr, indices, last = tables([500, 3])
    w = sim.wrapper()
    for i in range(6):
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        assert sim.counts["event_record"] == i + 1
        assert sim.counts["event_sync"] == max(0, i + 1 - 4)


def test_cuda_graph_replan_keeps_every_address(sim):
    bufs = (torch.zeros(5, dtype=torch.int32), torch.zeros(4096, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int32))
    w = sim.wrapper(graph_buffers=bufs)
    q, out = torch.zeros(4, HQ, D, dtype=BF16), torch.empty(4, HQ, D, dtype=BF16)
    seen = []
    for seed, lens in enumerate(([30, 5000, 1, 700], [9000, 16, 16, 3], [1, 1, 1, 20000])):
        indptr, indices, last = tables(lens, seed=seed)
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        w.run(q, cache_for(bufs[1]), out=out)
        a = sim.launches[-1][0]
        seen.append((a.kv_indptr, a.kv_indices, a.kv_last_page_len, a.work, a.num_work, a.merge_indptr,
                     a.part_o, a.part_lse, a.grid_items, a.merge_batch))
        assert (a.kv_indptr, a.kv_indices, a.kv_last_page_len) == tuple(b.data_ptr() for b in bufs)
        assert bufs[0].tolist() == indptr.tolist() and bufs[2].tolist() == last.tolist()
        assert bufs[1][: indices.numel()].tolist() == indices.tolist()
        plan = w._plan
        assert ints(w._staging.device_buf, a.num_work, 1) == [plan.num_items]
        assert ints(w._staging.device_buf, a.work, 4 * plan.num_items) == plan.work.reshape(-1).tolist()
    assert seen[0] == seen[1] == seen[2] and seen[0][8] == w._capacity and seen[0][9] == 4
    # the re-plans took the staged path: tables staged with the plan, then one copy call into bufs
    assert sim.counts["table_copies"] == 2 and w._h_indptr is None
    with pytest.raises(InputError, match="built for batch 4"):
        w.plan(*tables([5, 5]), HQ, HKV, D, PS, q_data_type=BF16)
    with pytest.raises(InputError, match="before plan"):  # the failed plan left it unplanned
        w.run(q, cache_for(bufs[1]), out=out)
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    sim.capturing = True  # a graph wrapper may be captured
    w.run(q, cache_for(bufs[1]), out=out)


def test_options_are_remembered_per_value(sim):
    indptr, indices, last = tables([800, 20])
    w = sim.wrapper()
    q = torch.zeros(2, HQ, D, dtype=BF16)
    cache = cache_for(indices)
    for cap, theta, scale in ((None, None, None), (20.0, 5e5, 0.1), (None, None, None), (20.0, 5e5, 0.1)):
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, logits_soft_cap=cap, rope_theta=theta,
               sm_scale=torch.tensor(scale) if scale else None)
        w.run(q, cache)
        a = sim.launches[-1][0]
        assert (a.logits_soft_cap, a.rope_theta) == (cap or 0.0, theta or 1e4)
        assert a.sm_scale == pytest.approx(scale or 1 / math.sqrt(D))
    scale = torch.tensor(0.5)  # a tensor option is read by every plan, never remembered
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, sm_scale=scale)
    scale.fill_(0.25)
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, sm_scale=scale)
    w.run(q, cache)
    assert sim.launches[-1][0].sm_scale == 0.25


def test_cache_is_revalidated_when_a_plan_changes_the_geometry():
    # CPU backend: run() remembers a validated cache; a plan with another page size must not
    # reuse that verdict
    indptr, indices, last = tables([37, 9], ps=4)
    cache = torch.zeros(int(indices.max()) + 1, 2, 4, 2, 16, dtype=torch.float16)
    q = torch.zeros(2, 4, 16, dtype=torch.float16)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16)
    w.run(q, cache)
    w.plan(indptr, indices, torch.ones(2, dtype=torch.int32), 4, 2, 16, 2, q_data_type=torch.float16)
    with pytest.raises(InputError, match="page_size"):
        w.run(q, cache)


@pytest.mark.parametrize("seed", range(40))
def test_request_lengths_uniform_and_ragged_agree_with_kv_lengths(seed):
    rng = np.random.default_rng(seed)
    batch, ps = int(rng.integers(1, 50)), int(rng.choice([1, 4, 16]))
    if seed % 3 == 0:  # uniform, sometimes without pages
        pages = np.full(batch, int(rng.integers(0, 5)))
    else:
        pages = rng.integers(0 if seed % 3 == 1 else 1, 6, batch)
    last = np.where(pages > 0, rng.integers(1, ps + 1, batch), rng.integers(-3, 40, batch))
    if seed % 3 == 0:
        last[:] = last[0]
    indptr = np.concatenate(([0], np.cumsum(pages))).astype(np.int32)
    last = last.astype(np.int32)
    got = request_lengths(indptr, last, ps, int(indptr[-1]))
    want = kv_lengths(indptr, last, ps)
    assert np.array_equal(np.broadcast_to(got, want.shape), want)
    assert isinstance(got, int) == (seed % 3 == 0)


def test_request_lengths_errors_are_the_same_for_uniform_and_ragged_tables():
    two = np.array([0, 2, 4], np.int32)
    for last in (np.array([0, 0], np.int32), np.array([0, 3], np.int32)):
        with pytest.raises(InputError, match=r"last_page_len must be in \[1, page_size=16\]; request 0 has 0"):
            request_lengths(two, last, 16, 4)
    for indptr in (np.array([1, 3, 5], np.int32), np.array([0, 3, 2], np.int32), np.array([0, -1, -2], np.int32)):
        with pytest.raises(InputError, match="start at 0 and be non-decreasing"):
            request_lengths(indptr, np.ones(2, np.int32), 16, 4)
    with pytest.raises(InputError, match="exceeds the 3 page indices"):
        request_lengths(two, np.ones(2, np.int32), 16, 3)
    with pytest.raises(InputError, match="batch entries"):
        request_lengths(two, np.ones(3, np.int32), 16, 4)
    assert request_lengths(np.array([0], np.int32), np.zeros(0, np.int32), 16, 0) == 0


def _request_lengths_by_reductions(indptr, last, ps, num_indices):
    """request_lengths as it was written before its ragged path used argmin/argmax and int64
    in-place arithmetic: the behaviour (lengths, errors and their messages) it must keep."""
    batch = indptr.shape[0] - 1
    if batch < 0 or last.shape[0] != batch:
        raise InputError(f"indptr must have batch + 1 entries and last_page_len batch entries, "
                         f"got {indptr.shape[0]} and {last.shape[0]}")
    if not batch:
        return 0
    pages = indptr[1:] - indptr[:-1]
    min_pages = int(pages.min())
    if indptr[0] != 0 or min_pages < 0:
        raise InputError(f"indptr must start at 0 and be non-decreasing, got {indptr.tolist()[:16]}")
    if indptr[-1] > num_indices:
        raise InputError(f"indptr[-1] = {indptr[-1]} exceeds the {num_indices} page indices")
    if last.min() < 1 or last.max() > ps:
        bad = (pages > 0) & ((last < 1) | (last > ps))
        if np.any(bad):
            i = int(np.nonzero(bad)[0][0])
            raise InputError(f"last_page_len must be in [1, page_size={ps}]; request {i} has {last[i]}")
    if min_pages > 0:
        return pages.astype(np.int64) * ps - (ps - last)
    return kv_lengths(indptr, last, ps)


def _outcome(fn, *args):
    try:
        r = fn(*args)
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return (int, r) if isinstance(r, int) else (r.dtype, r.tolist())


@pytest.mark.parametrize("seed", range(60))
def test_request_lengths_ragged_path_keeps_lengths_and_errors(seed):
    """Ragged tables (every request with pages, or some without), valid or with one bad entry,
    against the reduction-based implementation: the same int64 lengths or the same error."""
    rng = np.random.default_rng(seed)
    batch, ps = int(rng.integers(2, 300)), int(rng.choice([1, 3, 16, 64, 2**31 - 1]))
    pages = rng.integers(0 if seed % 4 == 0 else 1, 600, batch)
    pages[0] += pages[1] == pages[0]  # not uniform
    last = rng.integers(1, min(ps, 2**20) + 1, batch)
    indptr = np.concatenate(([0], np.cumsum(pages))).astype(np.int32)
    last = np.where(pages > 0, last, rng.integers(-5, 50, batch)).astype(np.int32)
    nnz = int(indptr[-1])
    variants = [(indptr, last, nnz)]
    for value in (0, -1, ps + 1 if ps < 2**31 - 1 else 0, -2**31, 2**31 - 1):
        bad = last.copy()
        bad[int(rng.integers(batch))] = value
        variants.append((indptr, bad, nnz))
    decreasing = indptr.copy()
    decreasing[1] = decreasing[2] + 1
    variants += [(indptr, last, nnz - 1), (indptr + 1, last, nnz + 1), (decreasing, last, nnz)]
    for ip, la, n in variants:
        assert _outcome(request_lengths, ip, la, ps, n) == _outcome(_request_lengths_by_reductions, ip, la, ps, n)


def test_request_lengths_page_sizes_outside_the_int32_fast_path():
    """A page size that is not a Python int of int32 range takes the general path, which
    behaves as before (an int64 numpy page size, a bool, one beyond int32)."""
    indptr, last = np.array([0, 2, 5, 6], np.int32), np.array([3, 7, 1], np.int32)
    for ps in (np.int64(16), True, 2**31, 2**40):
        la = last if ps is not True else np.ones(3, np.int32)
        assert _outcome(request_lengths, indptr, la, ps, 6) == _outcome(_request_lengths_by_reductions, indptr, la,
                                                                        ps, 6)
    with pytest.raises(InputError, match=r"page_size=2147483648\]; request 0 has 0"):
        request_lengths(indptr, np.array([0, 7, 1], np.int32), 2**31, 6)


def test_host_tables_are_views_and_fail_like_host_i32():
    indptr, last = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([3, 16], dtype=torch.int32)
    hi, hl = host_tables(indptr, last)
    assert hi.ctypes.data == indptr.data_ptr() and hl.ctypes.data == last.data_ptr()
    assert hi.tolist() == [0, 2, 5] and hl.tolist() == [3, 16] and hi.dtype == hl.dtype == np.int32
    strided = torch.zeros(6, dtype=torch.int32)[::2]
    assert host_tables(strided, last)[0].tolist() == [0, 0, 0]
    class Sub(torch.Tensor):
        pass

    assert host_tables(indptr.as_subclass(Sub), last)[0].tolist() == [0, 2, 5]  # host_i32's path
    bad = [(indptr.long(), last), (indptr, last.long()), (indptr[None], last), (indptr, last[:, None]),
           (indptr.tolist(), last), (indptr, last.numpy()), (indptr.float(), last.long()), (indptr[0], last)]
    for a, b in bad:
        with pytest.raises(Exception) as want:
            host_i32("indptr", a)
            host_i32("last_page_len", b)
        with pytest.raises(type(want.value)) as got:
            host_tables(a, b)
        assert str(got.value) == str(want.value)


def test_staged_indices_are_the_first_nnz_entries(sim):
    """Host indices longer than indptr[-1], or strided, are staged as their first nnz entries."""
    indptr, indices, last = tables([100, 37, 900, 16])
    nnz = int(indptr[-1])
    longer = torch.cat([indices, torch.full((5,), 12345, dtype=torch.int32)])
    strided = torch.zeros(2 * nnz + 4, dtype=torch.int32)[::2]
    strided[:nnz] = indices
    q = torch.zeros(4, HQ, D, dtype=BF16)
    for ix in (indices, longer, strided):
        w = sim.wrapper()
        w.plan(indptr, ix, last, HQ, HKV, D, PS, q_data_type=BF16)
        w.run(q, cache_for(indices))
        a = sim.launches[-1][0]
        assert ints(w._staging.device_buf, a.kv_indices, nnz) == indices.tolist()
        assert ints(w._staging.device_buf, a.kv_indptr, 5) == indptr.tolist()
        assert ints(w._staging.device_buf, a.kv_last_page_len, 4) == last.tolist()


@pytest.mark.parametrize("extra", [0, 9])
def test_cuda_graph_tables_fill_exact_and_larger_buffers(sim, extra):
    indptr, indices, last = tables([30, 5000, 1])
    nnz = indices.numel()
    bufs = (torch.zeros(4, dtype=torch.int32), torch.full((nnz + extra,), -1, dtype=torch.int32),
            torch.full((3 + extra,), -1, dtype=torch.int32))
    w = sim.wrapper(graph_buffers=bufs)
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    w.run(torch.zeros(3, HQ, D, dtype=BF16), cache_for(indices))
    a = sim.launches[-1][0]
    assert (a.kv_indptr, a.kv_indices, a.kv_last_page_len) == tuple(b.data_ptr() for b in bufs)
    assert bufs[0].tolist() == indptr.tolist()
    assert bufs[1].tolist() == indices.tolist() + [-1] * extra
    assert bufs[2].tolist() == last.tolist() + [-1] * extra
    small = (torch.zeros(4, dtype=torch.int32), torch.zeros(nnz - 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(InputError, match=f"the CUDA-graph buffer holds {nnz - 1} entries, got {nnz}"):
        sim.wrapper(graph_buffers=small).plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)


def _staged_state(w, sim, q, cache, out):
    """(launch fields but the metadata addresses, metadata and tables as lists) of the wrapper's
    current plan, launched once."""
    w.run(q, cache, out=out)
    a = sim.launches[-1][0]
    buf = w._staging.device_buf
    B = q.shape[0]
    n = a.grid_items
    nnz = int(ints(buf, a.kv_indptr, B + 1)[-1])
    lists = (ints(buf, a.work, 4 * n), ints(buf, a.num_work, 1), ints(buf, a.merge_indptr, B + 1),
             ints(buf, a.kv_indptr, B + 1), ints(buf, a.kv_last_page_len, B), ints(buf, a.kv_indices, nnz))
    fields = (a.grid_items, a.merge_batch, a.part_o, a.part_lse - a.part_o, a.q, a.out, a.k, a.v,
              a.num_qo_heads, a.page_size, a.sm_scale, a.window_left)
    return fields, lists


@pytest.mark.parametrize("lens", [[600], [4096] * 3, [1, 5000, 0, 300, 17], [0, 0], [20000, 16], [8192] * 40])
def test_replan_takes_the_staged_path_and_stages_what_the_first_plan_does(sim, lens, monkeypatch):
    """A wrapper's second plan() with the same options checks, plans and stages the host tables
    in one native call (fi_plan_decode_staged): the same launch arguments, metadata and tables as
    a fresh wrapper's first plan, which takes the Python path."""
    from fi_attention.decode import batch as batch_mod

    indptr, indices, last = tables(lens)
    other = tables([7] * len(lens), seed=3)
    q = torch.zeros(len(lens), HQ, D, dtype=BF16)
    out = torch.empty_like(q)
    cache = cache_for(torch.cat([indices, other[1]]))
    fresh = sim.wrapper()
    fresh.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    want = _staged_state(fresh, sim, q, cache, out)

    w = sim.wrapper()
    w.plan(*other, HQ, HKV, D, PS, q_data_type=BF16)  # loads the module: the Python path

    def python_path_taken(*a, **k):
        raise AssertionError("host_tables ran: the staged path was not taken")

    monkeypatch.setattr(batch_mod, "host_tables", python_path_taken)
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    assert w._h_indptr is None
    got = _staged_state(w, sim, q, cache, out)
    assert got[1] == want[1]
    assert got[0][:2] == want[0][:2] and got[0][3:] == want[0][3:]
    assert got[0][2] == w._float_ws.data_ptr()
    monkeypatch.undo()
    assert w._host_tables()[0].tolist() == indptr.tolist()  # made when a checked run() asks


@pytest.mark.parametrize("bad, text", [
    (lambda ip, ix, la: (ip + 1, ix, la), "indptr must start at 0"),
    (lambda ip, ix, la: (torch.tensor([0, 5, 3, 9], dtype=torch.int32), ix, la), "non-decreasing"),
    (lambda ip, ix, la: (ip, ix[:10], la), "exceeds the 10 page indices"),
    (lambda ip, ix, la: (ip, ix, torch.tensor([3, 0, 4], dtype=torch.int32)), "last_page_len must be in"),
    (lambda ip, ix, la: (ip, ix, torch.tensor([3, 17, 4], dtype=torch.int32)), "last_page_len must be in"),
])
def test_staged_path_refuses_bad_tables_with_the_checked_paths_errors(sim, bad, text):
    indptr, indices, last = tables([40, 100, 60])
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    with pytest.raises(InputError, match=text):
        w.plan(*bad(indptr, indices, last), HQ, HKV, D, PS, q_data_type=BF16)


def test_staged_path_grows_the_metadata_buffer(sim):
    w = sim.wrapper()
    small = tables([40, 3])
    w.plan(*small, HQ, HKV, D, PS, q_data_type=BF16)
    size = w._staging.size
    big = tables([30000] * 64, seed=2)
    w.plan(*big, HQ, HKV, D, PS, q_data_type=BF16)
    assert w._staging.size > size and w._h_indptr is None
    q = torch.zeros(64, HQ, D, dtype=BF16)
    w.run(q, cache_for(big[1]))
    a = sim.launches[-1][0]
    assert ints(w._staging.device_buf, a.kv_indices, int(big[0][-1])) == big[1].tolist()


def test_cuda_graph_replans_stage_host_ids_up_to_the_graph_buffer(sim):
    """A graph wrapper's metadata buffer is sized at its first plan (its address is in captured
    kernels): with host page ids it holds as many as the graph's indices buffer, so requests that
    grow from a few pages to the whole buffer keep the staged path."""
    bufs = (torch.zeros(3, dtype=torch.int32), torch.zeros(4400, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    w = sim.wrapper(graph_buffers=bufs)
    q = torch.zeros(2, HQ, D, dtype=BF16)
    for i, lens in enumerate(([16, 16], [20, 16], [40000, 30000])):  # 2, 3, 4375 pages
        indptr, indices, last = tables(lens, seed=i)
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        assert sim.counts["table_copies"] == i  # the first plan copies the Python way, then staged
        w.run(q, cache_for(bufs[1]))
        a = sim.launches[-1][0]
        assert (a.kv_indptr, a.kv_indices, a.kv_last_page_len) == tuple(b.data_ptr() for b in bufs)
        assert bufs[0].tolist() == indptr.tolist() and bufs[2].tolist() == last.tolist()
        assert bufs[1][: indices.numel()].tolist() == indices.tolist()


def test_launch_flags_name_the_tables_plan_wrote(sim):
    """DecodeArgs.flags (decode_args.h, DecodeFlag): the kernel reads before its PDL wait only the
    tables plan() wrote itself. Host tables are staged or copied by plan() (every bit), on the
    first plan's Python path and on the staged re-plan alike."""
    every = launch.TABLES_EARLY | launch.INDICES_EARLY | launch.PDL | launch.GRID_MERGE
    lens = [30, 5000, 1, 700]
    q, out = torch.zeros(4, HQ, D, dtype=BF16), torch.empty(4, HQ, D, dtype=BF16)
    w = sim.wrapper()
    for seed in (0, 1):  # the Python path, then the staged one
        indptr, indices, last = tables(lens, seed=seed)
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        w.run(q, cache_for(indices), out=out)
        assert sim.launches[-1][0].flags == every | launch.REFUSE_CAPTURE  # not a CUDA-graph wrapper
    bufs = (torch.zeros(5, dtype=torch.int32), torch.zeros(4096, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int32))
    g = sim.wrapper(graph_buffers=bufs)
    for seed in (0, 1):
        indptr, indices, last = tables(lens, seed=seed)
        g.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        g.run(q, cache_for(bufs[1]), out=out)
        assert sim.launches[-1][0].flags == every
    # (Page ids the user wrote into the graph buffer itself are device memory, which the CPU
    # harness cannot tell from host tables: the GPU test test_pdl_chain covers that case.)


def test_split_plans_carry_zeroed_merge_counters(sim):
    """The in-grid merge (merge_in_grid, decode_common.cuh) counts arrivals per (request, query
    head) in a zeroed int32 buffer the wrapper owns: a split plan points at one with room for every
    counter, an unsplit plain plan at none (nothing to merge), a CUDA-graph plan always at the same
    one (a later re-plan may split)."""
    q = torch.zeros(2, HQ, D, dtype=BF16)
    w = sim.wrapper()
    indptr, indices, last = tables([20, 16])
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    assert not w._plan.split
    w.run(q, cache_for(indices))
    assert sim.launches[-1][0].merge_count == 0
    indptr, indices, last = tables([60000, 16])
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    assert w._plan.split
    w.run(q, cache_for(indices))
    a = sim.launches[-1][0]
    assert a.merge_count == w._counters.data_ptr() and a.flags & launch.GRID_MERGE
    assert w._counters.numel() >= 2 * HQ and not w._counters.any()
    bufs = (torch.zeros(3, dtype=torch.int32), torch.zeros(4096, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    g = sim.wrapper(graph_buffers=bufs)
    seen = set()
    for lens in ([20, 16], [60000, 16]):
        indptr, indices, last = tables(lens)
        g.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        g.run(q, cache_for(bufs[1]))
        seen.add(sim.launches[-1][0].merge_count)
    assert seen == {g._counters.data_ptr()}


def test_enable_pdl_false_clears_the_pdl_bit_for_that_run_only(sim):
    indptr, indices, last = tables([600, 9000])
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    q = torch.zeros(2, HQ, D, dtype=BF16)
    cache = cache_for(indices)
    w.run(q, cache, out=torch.empty_like(q), enable_pdl=True)
    assert sim.launches[-1][0].flags & launch.PDL
    w.run(q, cache, out=torch.empty_like(q), enable_pdl=False)
    assert not sim.launches[-1][0].flags & launch.PDL
    assert sim.launches[-1][0].flags & launch.INDICES_EARLY  # the table bits stay
    w.run(q, cache, out=torch.empty_like(q))  # the launch path's block has the planned flags again
    assert sim.launches[-1][0].flags & launch.PDL
    with pytest.raises(InputTypeError, match="enable_pdl must be None or a bool"):
        w.run(q, cache, enable_pdl=1)


def test_cuda_graph_plans_of_one_cta_per_sm_run_in_spread_mode(sim):
    """A CUDA-graph wrapper's plan of at most one CTA per SM is flagged for spread mode (the word
    after num_work, which decode_work reads with it) and every launch points at the wrapper's one
    zeroed queue; larger plans and plain wrappers are not flagged."""
    q = torch.zeros(4, HQ, D, dtype=BF16)
    bufs = (torch.zeros(5, dtype=torch.int32), torch.zeros(16384, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    g = sim.wrapper(graph_buffers=bufs)
    seen = []
    for lens in ([8000] * 4, [30000] * 4, [1, 17, 2500, 600], [8000] * 4):
        indptr, indices, last = tables(lens)
        g.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        g.run(q, cache_for(bufs[1]))
        a = sim.launches[-1][0]
        num_work, spread = ctypes.c_int32.from_address(a.num_work).value, ctypes.c_int32.from_address(a.num_work + 4).value
        assert num_work == g._plan.num_items
        assert spread == (0 < num_work * HKV <= SM_COUNT), (lens, num_work)
        assert a.sched == g._sched.data_ptr() and not g._sched.any()
        seen.append(spread)
    assert seen == [1, 0, 1, 1]
    w = sim.wrapper()
    indptr, indices, last = tables([8000] * 4)
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    w.run(q, cache_for(indices))
    a = sim.launches[-1][0]
    assert a.sched == 0 and ctypes.c_int32.from_address(a.num_work + 4).value == 0


def test_ragged_batches_take_piece_plans_on_both_plan_paths(sim):
    """On sm_90 (the simulator's GPU) a ragged batch whose chunk plan is unbalanced takes a piece
    plan: the first plan() (Python) and the next ones (the staged native call) stage the same
    chained items, and a CUDA-graph wrapper keeps it out of spread mode."""
    from fi_attention.decode.planner import PIECE_CONT, PIECE_NEXT  # noqa: PLC0415
    lens = torch.randint(1, 8193, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    indptr, indices, last = tables(lens)
    want = plan_decode(np.array(lens), kv_units=HKV, sm_count=SM_COUNT, ctas_per_sm=CTAS_PER_SM, pieces=True)
    assert want.pieces
    q = torch.zeros(64, HQ, D, dtype=BF16)
    w = sim.wrapper()
    for _ in range(2):  # the Python path, then the staged one
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        assert w._plan.pieces and np.array_equal(w._plan.packed, want.packed)
        w.run(q, cache_for(indices))
        a = sim.launches[-1][0]
        n = ctypes.c_int32.from_address(a.num_work).value
        work = np.ctypeslib.as_array((ctypes.c_int32 * (4 * n)).from_address(a.work))
        assert n == want.num_items and np.array_equal(work, want.work.reshape(-1))
        assert (work[0::4] & PIECE_NEXT).any() and (work[0::4] & PIECE_CONT).any()
    bufs = (torch.zeros(65, dtype=torch.int32), torch.zeros(40000, dtype=torch.int32), torch.zeros(64, dtype=torch.int32))
    g = sim.wrapper(graph_buffers=bufs)
    for _ in range(2):
        g.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        g.run(q, cache_for(bufs[1]))
        a = sim.launches[-1][0]
        assert g._plan.pieces and ctypes.c_int32.from_address(a.num_work + 4).value == 0  # no spread mode


def test_cuda_graph_replan_with_other_options_warns(sim, recwarn):
    """A captured graph keeps its capture's kernel and scalar arguments: a CUDA-graph wrapper
    re-planned with another window, scale or soft cap warns; re-plans with the same options and
    plain wrappers do not."""
    bufs = (torch.zeros(5, dtype=torch.int32), torch.zeros(4096, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    g = sim.wrapper(graph_buffers=bufs)
    indptr, indices, last = tables([100, 2000, 30, 5000])
    g.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    g.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    assert not recwarn.list
    with pytest.warns(UserWarning, match=r"window_left -1 -> 700.*capture them again"):
        g.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, window_left=700)
    with pytest.warns(UserWarning, match=r"logits_soft_cap 0.0 -> 30.0"):
        g.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, window_left=700, logits_soft_cap=30.0)
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, window_left=700)
    assert not [x for x in recwarn.list if "CUDA-graph" in str(x.message)]


def test_small_mha_batches_take_the_ring_and_large_ones_the_cuda_core_kernel(sim):
    """MHA batches of at most spec.MHA_RING_MAX_UNITS (request, kv head) units plan on the tensor-
    core ring (sm_90, 16-bit cache), larger ones on the CUDA-core kernel, and one wrapper re-planned
    between them switches kernels (and launches after each plan). MHA on an fp8 cache takes the
    ring at every size, backend="cuda-core" keeps the CUDA-core kernel, and GQA keeps the ring at
    every batch size."""
    from fi_attention.decode import spec  # noqa: PLC0415

    mha = spec.MHA_RING_MAX_UNITS // 32  # requests of 32 kv heads at the limit

    def kernel(batch, hkv=32, kv_dtype=BF16, **kw):
        w = sim.wrapper(**kw)
        indptr, indices, last = tables([100] * batch)
        w.plan(indptr, indices, last, 32, hkv, D, PS, q_data_type=BF16, kv_data_type=kv_dtype)
        return w._kernel_name

    assert kernel(1).startswith("batch_decode_mma_") and kernel(mha).startswith("batch_decode_mma_")
    assert kernel(mha + 1).startswith("batch_decode_bf16_bf16_")
    assert kernel(1, kv_dtype=torch.float8_e4m3fn).startswith("batch_decode_mma_bf16_e4m3_")
    assert kernel(4 * mha, kv_dtype=torch.float8_e5m2).startswith("batch_decode_mma_bf16_e5m2_")
    assert kernel(4 * mha, kv_dtype=torch.float8_e4m3fn, backend="cuda-core").startswith("batch_decode_bf16_e4m3_")
    assert kernel(1, backend="cuda-core").startswith("batch_decode_bf16_bf16_")
    assert kernel(mha + 1, use_tensor_cores=True).startswith("batch_decode_mma_")
    assert kernel(200, hkv=8).startswith("batch_decode_mma_")
    w = sim.wrapper()
    names = []
    for batch in (4, 40, 4):
        indptr, indices, last = tables([300] * batch)
        w.plan(indptr, indices, last, 32, 32, D, PS, q_data_type=BF16)
        q = torch.zeros(batch, 32, D, dtype=BF16)
        w.run(q, torch.zeros(int(indices.max()) + 1, 2, PS, 32, D, dtype=BF16), out=torch.empty_like(q))
        names.append(w._kernel_name)
        assert len(sim.launches) == len(names)  # one launch per run(), through the plan's launcher
    assert names[0] == names[2] != names[1] and names[0].startswith("batch_decode_mma_")


def test_torch_compile_traces_the_custom_op_with_the_launch_path_armed(sim):
    """The launch path's gate (torch.compiler.is_dynamo_compiling) sends a dynamo trace to the
    checked path and its custom op: with fullgraph=True a traced ctypes launch would fail."""
    indptr, indices, last = tables([300, 40])
    w = sim.wrapper()
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
    cache = cache_for(indices)
    q = torch.zeros(2, HQ, D, dtype=BF16)
    w.run(q, cache)
    w.run(q, cache)  # the cache is remembered: the launch path
    assert w._fast_gen == knobs.GENERATION[0]
    f = torch.compile(lambda q, c: w.run(q, c), fullgraph=True, backend="eager")
    n = len(sim.launches)
    f(q, cache)
    f(q, cache)
    assert len(sim.launches) == n + 2
    assert (sim.launches[-1][0].k, sim.launches[-1][0].q) == (cache.data_ptr(), q.data_ptr())


def test_check_inputs_toggles_the_launch_path_by_the_knobs_generation(sim):
    """The launch path runs while _fast_gen is the knobs' generation: FI_CHECK_INPUTS on (at plan()
    or later) sends every call to the checked path, and the first checked call after it is off
    again re-arms the launch path."""
    indptr, indices, last = tables([300, 40])
    w = sim.wrapper()
    cache = cache_for(indices)
    q = torch.zeros(2, HQ, D, dtype=BF16)
    with knobs.override(FI_CHECK_INPUTS="1"):
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16)
        assert w._fast_gen == -1
        w.run(q, cache)
        assert w._fast_gen == -1
    w.run(q, cache)  # checks off again: this checked call re-arms the launch path
    assert w._fast_gen == knobs.GENERATION[0]
    with knobs.override(FI_CHECK_INPUTS="1"):
        assert w._fast_gen != knobs.GENERATION[0]  # the override moved the generation
        bad = cache_for(indices)[:1]  # one page: the planned page ids point past it
        with pytest.raises(InputError, match="page indices"):
            w.run(q, bad)
    w.run(q, cache)
    assert w._fast_gen == knobs.GENERATION[0]


def test_dense_q_strides_pass_the_launch_path_tests():
    """run()'s launch path skips the stride tests for a contiguous q (dense strides (Hq * D, D, 1)),
    which is right only while every head_dim of the CUDA kernels is a multiple of 8."""
    from fi_attention.decode.spec import HEAD_DIMS

    assert HEAD_DIMS and all(d % 8 == 0 for d in HEAD_DIMS)


def test_decode_args_mirror_the_c_struct_field_for_field():
    """The ctypes DecodeArgs and ``struct DecodeArgs`` (decode_args.h) name the same 8-byte fields
    in the same order, with the same types: the launcher reads the block by offset."""
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    header = (Path(launch.__file__).parent / "decode_args.h").read_text()
    body = header.split("struct DecodeArgs {", 1)[1].split("};", 1)[0]
    c_fields = []
    for kind, names in re.findall(r"^\s*(int64_t|double)\s+([^;]+);", body, re.M):
        c_fields += [(n.strip(), ctypes.c_int64 if kind == "int64_t" else ctypes.c_double) for n in names.split(",")]
    assert c_fields == list(DecodeArgs._fields_)
    assert ctypes.sizeof(DecodeArgs) == 8 * len(c_fields)
    assert c_fields[-1][0] == "device"  # the GPU the launcher makes current (decode_common.cuh)

"""GPU tests of batch and single decode against the fp32 reference.

Grids are reduced: the batch x kv_len x page_size grid runs on the main config (bf16, 32/8 heads,
head_dim 128, NHD); every other feature (head dims, group sizes, dtypes, layouts, cache forms,
soft cap, window, ALiBi, RoPE, LSE, CUDA graphs) runs on one or two mid-size shapes that still
exercise split-KV (a long request in a small batch) and the unsplit path.
"""

import pytest
import torch

from fi_core import arch_of, build_many, testing
from fi_core.errors import InputError
from fi_attention import (BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
                          single_decode_with_kv_cache)
from fi_attention.decode import batch as decode_batch
from fi_attention.decode import spec as decode_spec
from fi_attention.decode.spec import select_spec
from fi_attention.reference import attention_reference, batch_decode_reference, gather_paged_kv

pytestmark = testing.gpu_only()
DEV = "cuda"
# Both decode kernels: the tensor-core one (decode_mma.cu; falls back to the CUDA-core kernel where
# it does not apply: head_dim 256, RoPE, mixed 16-bit dtypes) and the CUDA-core one (decode.cu).
KERNELS = pytest.mark.parametrize("backend", ["tensor-core", "cuda-core"])
LSE_TOL = dict(dtype=torch.float32, atol=2e-3, rtol=1e-3)


@pytest.fixture(scope="module", autouse=True)
def _prebuild_modules():
    """Compile every decode module this file uses in one parallel build (FI_MAX_JOBS), instead
    of one at a time inside the first test that needs each."""
    arch = arch_of(torch.device(DEV))
    bf, hf, e4, e5 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
    cases = [(bf, bf, 128, 4, p, c) for p, c in (("NONE", False), ("NONE", True), ("ALIBI", False),
                                                 ("ROPE_LLAMA", False))]
    cases += [(bf, bf, 128, 8, "NONE", False), (hf, e4, 128, 8, "ROPE_LLAMA", True)]
    cases += [(hf, hf, d, g, "NONE", False) for d in (64, 128, 256) for g in (1, 4, 8, 16, 6, 7)]
    cases += [(q, kv, 128, 4, "NONE", False) for q in (bf, hf) for kv in (e4, e5)]
    specs = {select_spec(q, kv, d, g, pos, cap, arch, kernel)
             for q, kv, d, g, pos, cap in cases for kernel in ("tensor-core", "cuda-core")}
    build_many(sorted(specs, key=lambda sp: sp.name))


def make_batch(lens, page_size, hkv, d, dtype=torch.bfloat16, layout="NHD", seed=0, tuple_cache=False,
               spare_pages=5):
    """A shuffled page table (pages of different requests interleave) and a random cache."""
    pages = [max(1, -(-n // page_size)) for n in lens]
    total = sum(pages) + spare_pages
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[: sum(pages)]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32)
    shape = (total, 2, page_size, hkv, d) if layout == "NHD" else (total, 2, hkv, page_size, d)
    # drawn on the GPU: the large grid points would spend seconds in CPU randn otherwise
    cache = torch.randn(shape, device=DEV, generator=torch.Generator(DEV).manual_seed(seed + 1)).to(dtype)
    if tuple_cache:
        cache = (cache[:, 0].clone(), cache[:, 1].clone())
    return cache, indptr, perm.to(torch.int32), last


def lengths(batch, kv_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, kv_len + 1, (batch,), generator=g).tolist()
    lens[-1] = kv_len
    return lens


def run_decode(lens, ps, hq, hkv, d, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, layout="NHD",
               tuple_cache=False, plan_kw=None, run_kw=None, ref_kw=None, host_tables=True, seed=0,
               backend="auto"):
    cache, indptr, indices, last = make_batch(lens, ps, hkv, d, kv_dtype, layout, seed, tuple_cache)
    q = testing.randn((len(lens), hq, d), q_dtype, DEV, seed=seed + 7)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    w = BatchDecodeWithPagedKVCacheWrapper(ws, layout, backend=backend)
    tables = (indptr, indices, last) if host_tables else (indptr.to(DEV), indices.to(DEV), last.to(DEV))
    w.plan(*tables, hq, hkv, d, ps, q_data_type=q_dtype, kv_data_type=kv_dtype, **(plan_kw or {}))
    out = testing.empty_poisoned(q.shape, q_dtype, DEV)
    lse = testing.empty_poisoned((len(lens), hq), torch.float32, DEV)
    w.run(q, cache, out=out, lse=lse, **(run_kw or {}))
    ro, rl = batch_decode_reference(q, cache, indptr, indices, last, layout, return_lse=True, **(ref_kw or {}))
    return out, lse, ro, rl, w


# batch x kv_len x page_size on the main config. batch 128 uses a shorter maximum length (its
# requests are random lengths up to kv_len; 128 x 16384 x page 1 adds nothing the others miss).
GRID = [(b, n, ps) for b in (1, 7, 128) for n in (1, 15, 97, 2048, 16384) for ps in (1, 16)
        if not (b == 128 and n == 16384)]


@pytest.mark.parametrize("batch,kv_len,page_size", GRID)
@KERNELS
def test_batch_decode_grid(batch, kv_len, page_size, backend):
    lens = lengths(batch, kv_len, seed=batch + kv_len)
    out, lse, ro, rl, _ = run_decode(lens, page_size, 32, 8, 128, backend=backend)
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    testing.assert_close(lse, rl, **LSE_TOL)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 4), (32, 4), (32, 2), (12, 2), (7, 1)])
@KERNELS
def test_head_dims_and_groups(d, hq, hkv, backend):
    lens = [3000, 17, 1]  # one split request, two direct ones
    out, lse, ro, rl, _ = run_decode(lens, 16, hq, hkv, d, q_dtype=torch.float16, kv_dtype=torch.float16, backend=backend)
    testing.assert_close(out, ro, dtype=torch.float16)
    testing.assert_close(lse, rl, **LSE_TOL)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@KERNELS
def test_fp8_kv_with_scales(kv_dtype, q_dtype, backend):
    lens = [5000, 333, 2]
    ks, vs = 0.7, 1.9
    out, lse, ro, rl, _ = run_decode(lens, 16, 32, 8, 128, q_dtype=q_dtype, kv_dtype=kv_dtype,
                                     run_kw=dict(k_scale=ks, v_scale=vs),
                                     ref_kw=dict(k_scale=ks, v_scale=vs), backend=backend)
    testing.assert_close(out, ro, dtype=q_dtype)
    testing.assert_close(lse, rl, **LSE_TOL)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lens", [[5000, 333, 2], [700] * 40])
def test_mha_auto_kernel_choice(kv_dtype, d, lens):
    """MHA on "auto": the ring on sm_90 for fp8 caches at any batch and for small 16-bit batches
    (spec.MHA_RING_MAX_UNITS), the CUDA-core kernel otherwise; either way against the reference."""
    ks, vs = (0.7, 1.9) if kv_dtype != torch.bfloat16 else (None, None)
    scales = dict(k_scale=ks, v_scale=vs) if ks is not None else {}
    out, lse, ro, rl, w = run_decode(lens, 16, 16, 16, d, kv_dtype=kv_dtype, run_kw=scales, ref_kw=scales)
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    testing.assert_close(lse, rl, **LSE_TOL)
    if torch.cuda.get_device_capability() >= (9, 0):
        ring = kv_dtype != torch.bfloat16 or len(lens) * 16 <= 512
        assert w._kernel_name.startswith("batch_decode_mma_") == ring, w._kernel_name


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("tuple_cache", [False, True])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@KERNELS
def test_layouts_and_cache_forms(layout, tuple_cache, page_size, backend):
    lens = [1200, 40, 7, 1]
    out, lse, ro, rl, _ = run_decode(lens, page_size, 16, 2, 128, layout=layout, tuple_cache=tuple_cache,
                                     host_tables=False, backend=backend)
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    testing.assert_close(lse, rl, **LSE_TOL)


def test_non_contiguous_cache_view():
    lens = [900, 33]
    cache, indptr, indices, last = make_batch(lens, 16, 8, 128)
    view = cache[:, :, :, 2:6]  # 4 of 8 kv heads: page/token strides of the full cache
    q = testing.randn((2, 16, 128), torch.bfloat16, DEV, seed=3)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV))
    w.plan(indptr, indices, last, 16, 4, 128, 16, q_data_type=torch.bfloat16)
    out = w.run(q, view)
    ref = batch_decode_reference(q, view, indptr, indices, last)
    testing.assert_close(out, ref, dtype=torch.bfloat16)


OPTIONS = [
    ("softcap", dict(logits_soft_cap=30.0), dict(logits_soft_cap=30.0)),
    ("window", dict(window_left=100), dict(window_left=100)),
    ("alibi", dict(pos_encoding_mode="ALIBI"), dict(pos_encoding_mode="ALIBI")),
    ("rope", dict(pos_encoding_mode="ROPE_LLAMA"), dict(pos_encoding_mode="ROPE_LLAMA")),
    ("rope_scaled", dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5),
     dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5)),
    ("sm_scale", dict(sm_scale=0.05), dict(sm_scale=0.05)),
]


@pytest.mark.parametrize("name,plan_kw,ref_kw", OPTIONS, ids=[o[0] for o in OPTIONS])
@KERNELS
def test_attention_options(name, plan_kw, ref_kw, backend):
    lens = [2048, 150, 1]
    out, lse, ro, rl, _ = run_decode(lens, 16, 32, 8, 128, plan_kw=plan_kw, ref_kw=ref_kw, backend=backend)
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    testing.assert_close(lse, rl, **LSE_TOL)


@KERNELS
def test_mixed_table_placement_survives_allocations_before_run(backend):
    """Host indptr / last_page_len next to device indices (how serving engines keep a page table):
    plan() copies the host tables to the device. Small tensors allocated and filled between plan()
    and run() (here with page ids far past the cache) must not land in those copies: the wrapper
    holds them until the next plan."""
    lens = lengths(7, 2048, seed=11)
    cache, indptr, indices, last = make_batch(lens, 16, 8, 128, seed=11)
    q = testing.randn((len(lens), 32, 128), torch.bfloat16, DEV, seed=12)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV), backend=backend)
    w.plan(indptr, indices.to(DEV), last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    junk = [torch.full((n,), 1 << 30, dtype=torch.int32, device=DEV) for n in (8, 16, 64, 128) for _ in range(32)]
    out = w.run(q, cache)
    del junk
    testing.assert_close(out, batch_decode_reference(q, cache, indptr, indices, last, "NHD"), dtype=torch.bfloat16)


@KERNELS
def test_replans_of_one_wrapper_stay_correct(backend):
    """A wrapper planned again and again, as a serving loop does: from its second plan() on, host
    tables take the staged path (one native call checks, plans and stages them) with the page ids
    on the host or on the device, in every split mode, for batches that grow past the first
    plan's metadata buffer and for a decode loop's next steps."""
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV), backend=backend)
    steps = [(lengths(3, 500, seed=1), {}, True), (lengths(7, 9000, seed=2), {}, False),
             (lengths(7, 9000, seed=2), dict(disable_split_kv=True), True),
             (lengths(64, 4096, seed=3), dict(fixed_split_size=9), False),
             (lengths(128, 2048, seed=4), {}, True), ([1, 17, 4000], {}, False)]
    base = lengths(16, 3000, seed=5)
    steps += [([n + i for n in base], {}, i % 2 == 0) for i in range(3)]  # decode steps: one token more
    for i, (lens, kw, host_ids) in enumerate(steps):
        cache, indptr, indices, last = make_batch(lens, 16, 8, 128, seed=20 + i)
        q = testing.randn((len(lens), 32, 128), torch.bfloat16, DEV, seed=40 + i)
        w.plan(indptr, indices if host_ids else indices.to(DEV), last, 32, 8, 128, 16,
               q_data_type=torch.bfloat16, **kw)
        assert (w._h_indptr is None) == (i > 0)  # the staged path from the second plan on
        lse = testing.empty_poisoned((len(lens), 32), torch.float32, DEV)
        out = w.run(q, cache, lse=lse)
        ro, rl = batch_decode_reference(q, cache, indptr, indices, last, "NHD", return_lse=True)
        testing.assert_close(out, ro, dtype=torch.bfloat16, msg=f"step {i}: ")
        testing.assert_close(lse, rl, **LSE_TOL)


def test_window_left_at_run_overrides_plan():
    lens = [700, 64]
    out, lse, ro, rl, _ = run_decode(lens, 16, 32, 8, 128, run_kw=dict(window_left=31),
                                     ref_kw=dict(window_left=31))
    testing.assert_close(out, ro, dtype=torch.bfloat16)


@pytest.mark.parametrize("split", ["auto", "disabled", "fixed"])
@KERNELS
def test_split_modes_agree(split, backend):
    lens = [9000, 4000, 1]
    kw = {"auto": {}, "disabled": dict(disable_split_kv=True), "fixed": dict(fixed_split_size=7)}[split]
    out, lse, ro, rl, w = run_decode(lens, 16, 32, 8, 128, plan_kw=kw, backend=backend)
    assert w._plan.split == (split != "disabled")
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    testing.assert_close(lse, rl, **LSE_TOL)


def test_return_values_and_allocation():
    lens = [100, 5]
    cache, indptr, indices, last = make_batch(lens, 16, 8, 128)
    q = testing.randn((2, 32, 128), torch.bfloat16, DEV, seed=1)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    w.begin_forward(indptr, indices, last, 32, 8, 128, 16, data_type=torch.bfloat16)
    o1 = w.run(q, cache)
    o2, l2 = w.run(q, cache, return_lse=True)
    o3 = w.forward(q, cache)
    assert torch.equal(o1, o2) and torch.equal(o1, o3) and l2.shape == (2, 32)
    # destinations on another device are refused on the launch path and the checked path alike
    for kw in ({"out": torch.empty(2, 32, 128, dtype=torch.bfloat16)},
               {"lse": torch.empty(2, 32, dtype=torch.float32), "return_lse": True}):
        with pytest.raises(InputError, match="on cpu"):
            w.run(q, cache, **kw)
    w.end_forward()


def test_batch_equals_single_decode_per_request():
    lens = [4096, 77, 1]
    cache, indptr, indices, last = make_batch(lens, 16, 8, 128, seed=4)
    q = testing.randn((3, 32, 128), torch.bfloat16, DEV, seed=5)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV))
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    out, lse = w.run(q, cache, return_lse=True)
    for b in range(3):
        k, v = gather_paged_kv(cache, indptr, indices, last, b)
        so, sl = single_decode_with_kv_cache(q[b], k, v, return_lse=True)
        testing.assert_close(out[b], so, dtype=torch.bfloat16)
        testing.assert_close(lse[b], sl, **LSE_TOL)


@pytest.mark.parametrize("kv_len", [1, 97, 32768])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_single_decode(kv_len, layout, use_tensor_cores):
    q = testing.randn((32, 128), torch.bfloat16, DEV, seed=1)
    k = testing.randn((kv_len, 8, 128), torch.bfloat16, DEV, seed=2)
    v = testing.randn((kv_len, 8, 128), torch.bfloat16, DEV, seed=3)
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    o, lse = single_decode_with_kv_cache(q, kk, vv, kv_layout=layout, return_lse=True,
                                         use_tensor_cores=use_tensor_cores)
    ro, rl = attention_reference(q[None], k, v, return_lse=True)
    testing.assert_close(o, ro[0], dtype=torch.bfloat16)
    testing.assert_close(lse, rl[0], **LSE_TOL)


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_single_decode_split_on_streams_and_in_a_graph(use_tensor_cores):
    """A split single decode merges in the grid on per-stream counters, and through the merge
    kernel while it is captured (the graph may replay on any stream): two side streams at once
    (equal to the eager result bit for bit), then a captured call replayed after its input
    changed (against the reference and the eager call)."""
    q = testing.randn((32, 128), torch.bfloat16, DEV, seed=1)
    k = testing.randn((20000, 8, 128), torch.bfloat16, DEV, seed=2)
    v = testing.randn((20000, 8, 128), torch.bfloat16, DEV, seed=3)
    eager = single_decode_with_kv_cache(q, k, v, use_tensor_cores=use_tensor_cores)
    testing.assert_close(eager, attention_reference(q[None], k, v)[0], dtype=torch.bfloat16)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    outs = []
    for s in (s1, s2, s1, s2):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(single_decode_with_kv_cache(q, k, v, use_tensor_cores=use_tensor_cores))
    torch.cuda.synchronize()
    for o in outs:
        assert torch.equal(o, eager)
    qg = q.clone()
    single_decode_with_kv_cache(qg, k, v, use_tensor_cores=use_tensor_cores)  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        og = single_decode_with_kv_cache(qg, k, v, use_tensor_cores=use_tensor_cores)
    q2 = testing.randn((32, 128), torch.bfloat16, DEV, seed=9)
    qg.copy_(q2)
    g.replay()
    torch.cuda.synchronize()
    testing.assert_close(og, attention_reference(q2[None], k, v)[0], dtype=torch.bfloat16)
    # (the merge kernel sums in another order than the in-grid merge: close, not equal bits)
    testing.assert_close(og, single_decode_with_kv_cache(q2, k, v, use_tensor_cores=use_tensor_cores),
                         dtype=torch.bfloat16)


def test_single_decode_options_and_fp8():
    q = testing.randn((32, 128), torch.float16, DEV, seed=1)
    k = testing.randn((3000, 4, 128), torch.float32, DEV, seed=2).to(torch.float8_e4m3fn)
    v = testing.randn((3000, 4, 128), torch.float32, DEV, seed=3).to(torch.float8_e4m3fn)
    kw = dict(pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=20.0, window_left=1000)
    o = single_decode_with_kv_cache(q, k, v, k_scale=0.5, v_scale=2.0, **kw)
    ro = attention_reference(q[None], k, v, k_scale=0.5, v_scale=2.0, **kw)
    testing.assert_close(o, ro[0], dtype=torch.float16)


def test_single_decode_fp8_past_2g_elements_of_one_page():
    # single decode puts the request in one page: at 2^21 + 37 tokens of 8 x 128 fp8 the in-page
    # offset of the last rows (token x token stride) passes 2^31 elements, which the fp8 ring's
    # 64-bit row offsets must carry
    n = (1 << 21) + 37
    q = testing.randn((32, 128), torch.bfloat16, DEV, seed=4)
    k = torch.empty(n, 8, 128, device=DEV).normal_(generator=torch.Generator(DEV).manual_seed(5)).to(torch.float8_e4m3fn)
    v = torch.empty(n, 8, 128, device=DEV).normal_(generator=torch.Generator(DEV).manual_seed(6)).to(torch.float8_e4m3fn)
    # the last rows decide the check: give the final 64 tokens the largest scores
    k[-64:] = (q.view(8, 4, 128).mean(1) * 4).to(torch.float8_e4m3fn)
    o = single_decode_with_kv_cache(q, k, v, k_scale=0.5, v_scale=2.0)
    ro = torch.empty(32, 128, device=DEV)  # per kv head in fp32 (the reference's GQA expansion would take ~85 GB)
    for h in range(8):
        s = (q[4 * h: 4 * h + 4].float() @ k[:, h].float().T) * (0.5 / 128 ** 0.5)
        ro[4 * h: 4 * h + 4] = torch.softmax(s, dim=-1) @ (v[:, h].float() * 2.0)
    testing.assert_close(o, ro, dtype=torch.bfloat16)


def _graph_tables(lens, ps, max_pages, seed):
    pages = [-(-n // ps) for n in lens]
    perm = torch.randperm(max_pages, generator=torch.Generator().manual_seed(seed))[: sum(pages)]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr, perm.to(torch.int32), last


@KERNELS
def test_cuda_graph_replay_after_replan(backend):
    ps, hq, hkv, d, max_pages = 16, 32, 8, 128, 2048
    cache = testing.randn((max_pages, 2, ps, hkv, d), torch.bfloat16, DEV, seed=1)
    q = testing.randn((4, hq, d), torch.bfloat16, DEV, seed=2)
    indptr_buf = torch.zeros(5, dtype=torch.int32, device=DEV)
    indices_buf = torch.zeros(max_pages, dtype=torch.int32, device=DEV)
    last_buf = torch.zeros(4, dtype=torch.int32, device=DEV)
    w = BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device=DEV), use_cuda_graph=True,
        paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
        paged_kv_last_page_len_buffer=last_buf, backend=backend)
    out = torch.empty_like(q)
    lse = torch.empty(4, hq, dtype=torch.float32, device=DEV)
    first = _graph_tables([30, 5000, 1, 700], ps, max_pages, seed=3)
    w.plan(*first, hq, hkv, d, ps, q_data_type=torch.bfloat16)
    w.run(q, cache, out=out, lse=lse)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out, lse=lse)
    # re-plans take the staged path (the tables go through the metadata buffer into the graph's
    # buffers); the page ids come from the host, from another device tensor, or are already in
    # the graph's indices buffer
    for seed, lens, ids in ((3, [30, 5000, 1, 700], "host"), (4, [9000, 16, 16, 3], "host"),
                            (5, [1, 1, 1, 20000], "host"), (6, [700, 3, 4000, 9], "device"),
                            (7, [20, 2000, 333, 1], "in_buf")):
        tables = _graph_tables(lens, ps, max_pages, seed)
        indices = tables[1]
        if ids == "device":
            indices = indices.to(DEV)
        elif ids == "in_buf":
            indices_buf[: indices.numel()].copy_(indices)
            indices = indices_buf
        indices_buf_before = indices_buf.clone() if ids == "in_buf" else None
        w.plan(tables[0], indices, tables[2], hq, hkv, d, ps, q_data_type=torch.bfloat16)
        assert w._h_indptr is None
        if indices_buf_before is not None:
            assert torch.equal(indices_buf, indices_buf_before)
        out.fill_(float("nan"))
        g.replay()
        ro, rl = batch_decode_reference(q, cache, *tables, return_lse=True)
        testing.assert_close(out, ro, dtype=torch.bfloat16, msg=f"lens {lens}: ")
        testing.assert_close(lse, rl, **LSE_TOL)


@KERNELS
@pytest.mark.parametrize("claims", [True, False])
def test_cuda_graph_spread_mode(backend, claims):
    """CUDA-graph wrappers run plans of at most one CTA per SM in spread mode: the first CTA of a
    launch on each SM takes the next unit from a queue, and the launch's last CTA takes whatever is
    left. claims=False builds the kernel without the SM claims, so that CTA runs every unit one
    after the other. Either way each replay must give the plain wrapper's bits, across re-plans
    that switch spread mode off and on again under the same captured graph."""
    if not claims and backend == "cuda-core":
        pytest.skip("the claims switch is a tensor-core build option (spec.MMA_AB)")
    ps, hq, hkv, d, max_pages, B = 16, 32, 8, 128, 8192, 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cache = testing.randn((max_pages, 2, ps, hkv, d), torch.bfloat16, DEV, seed=11)
    q = testing.randn((B, hq, d), torch.bfloat16, DEV, seed=12)
    bufs = (torch.zeros(B + 1, dtype=torch.int32, device=DEV), torch.zeros(max_pages, dtype=torch.int32, device=DEV),
            torch.zeros(B, dtype=torch.int32, device=DEV))
    saved = decode_spec.MMA_AB
    decode_spec.MMA_AB = {} if claims else {"FI_DECODE_SPREAD_CLAIMS": 0}
    decode_spec.decode_mma_spec.cache_clear()
    try:
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV),
                                               use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
                                               paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
                                               backend=backend)
        plain = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV),
                                                   backend=backend)
        out = torch.empty_like(q)
        lse = torch.empty(B, hq, dtype=torch.float32, device=DEV)
        first = _graph_tables([8000, 8000, 8000, 8000], ps, max_pages, seed=13)
        w.plan(*first, hq, hkv, d, ps, q_data_type=torch.bfloat16)
        w.run(q, cache, out=out, lse=lse)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(3):
                w.run(q, cache, out=out, lse=lse)
        seen = set()
        for seed, lens in ((13, [8000, 8000, 8000, 8000]), (14, [30000, 30000, 30000, 30000]),
                           (15, [1, 17, 2500, 600]), (16, [32000, 32000, 32000, 32000]), (17, [5, 4000, 9, 1])):
            tables = _graph_tables(lens, ps, max_pages, seed)
            w.plan(*tables, hq, hkv, d, ps, q_data_type=torch.bfloat16)
            spread = w._spread  # the word plan() wrote after num_work
            assert spread == (w._plan.num_items * hkv <= sms), (lens, w._plan.num_items)
            seen.add(spread)
            plain.plan(*tables, hq, hkv, d, ps, q_data_type=torch.bfloat16)
            want_o, want_l = plain.run(q, cache, return_lse=True)
            ro, rl = batch_decode_reference(q, cache, *tables, return_lse=True)
            testing.assert_close(want_o, ro, dtype=torch.bfloat16, msg=f"lens {lens}: ")
            same_plan = w._plan.work.shape == plain._plan.work.shape and (w._plan.work == plain._plan.work).all()
            for r in range(4):
                out.fill_(float("nan"))
                g.replay()
                testing.assert_close(out, ro, dtype=torch.bfloat16, msg=f"lens {lens} replay {r}: ")
                testing.assert_close(lse, rl, **LSE_TOL)
                if same_plan:  # the same units, merged in slot order: the same bits
                    assert torch.equal(out, want_o) and torch.equal(lse, want_l), f"lens {lens} replay {r}"
            assert not w._counters.any(), f"lens {lens}: arrival counters left {w._counters.nonzero()}"
        assert seen == {0, 1}, "the plans must cover spread mode on and off"
    finally:
        decode_spec.MMA_AB = saved
        decode_spec.decode_mma_spec.cache_clear()


@KERNELS
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("graph", [False, True])
def test_piece_plans(backend, kv_dtype, graph):
    """Plans of balanced pieces (planner.plan_pieces, sm_90+): a ragged batch takes one by the
    planner's choice, and forced piece plans (planner.PIECE_WAVES) cover short, empty and long
    requests with a window and the LSE, plain and under a captured graph re-planned between piece
    and chunk plans; every result against the reference, the arrival counters back at 0."""
    import numpy as np  # noqa: PLC0415
    from fi_attention.decode import planner as decode_planner  # noqa: PLC0415
    if arch_of(torch.device(DEV)).major < 9:
        pytest.skip("piece chains run on sm_90+ (planner.plan_pieces)")
    ps, hq, hkv, d, max_pages, B = 16, 32, 8, 128, 40000, 64
    cache = testing.randn((max_pages, 2, ps, hkv, d), torch.bfloat16, DEV, seed=21).to(kv_dtype)
    q = testing.randn((B, hq, d), torch.bfloat16, DEV, seed=22)
    scales = {} if kv_dtype == torch.bfloat16 else dict(k_scale=0.7, v_scale=1.3)
    bufs = (torch.zeros(B + 1, dtype=torch.int32, device=DEV), torch.zeros(max_pages, dtype=torch.int32, device=DEV),
            torch.zeros(B, dtype=torch.int32, device=DEV))
    kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
              paged_kv_last_page_len_buffer=bufs[2]) if graph else {}
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV), backend=backend,
                                           **kw)
    out = torch.empty_like(q)
    lse = torch.empty(B, hq, dtype=torch.float32, device=DEV)
    ragged = torch.randint(1, 8193, (B,), generator=torch.Generator().manual_seed(2)).tolist()
    rng = np.random.default_rng(3)
    short = [int(x) for x in rng.integers(0, 600, B)]  # empty requests among them
    mixed = [int(x) for x in rng.choice([0, 1, 17, 130, 3000, 20000], B)]
    # (a captured graph keeps the scalars of its capture, window_left among them: plain wrappers only)
    window = {} if graph else {"window_left": 700}
    cases = [("ragged", ragged, None, {}), ("short", short, 1, {}), ("mixed", mixed, 1, window),
             ("two_waves", ragged, 2, {}), ("uniform", [4096] * B, None, {})]
    g = None
    try:
        for name, lens, waves, opts in cases:
            tables = _graph_tables(lens, ps, max_pages, seed=len(name))
            decode_planner.PIECE_WAVES = waves
            decode_planner.plan_uniform.cache_clear()
            try:
                w.plan(*tables, hq, hkv, d, ps, q_data_type=torch.bfloat16, kv_data_type=kv_dtype, **opts)
            finally:
                decode_planner.PIECE_WAVES = None
                decode_planner.plan_uniform.cache_clear()
            if waves is None:  # the planner's choice, as plan_decode makes it for this module and GPU
                o = next(iter(w._options.values()))  # kv units and kernel: the same for every case
                lens_np = np.array(lens)
                want = lens_np.min() < lens_np.max() and decode_planner.plan_decode(
                    lens_np, kv_units=o.kv_units, sm_count=o.kernel[4], ctas_per_sm=o.kernel[3], pieces=True).pieces
                assert w._plan.pieces == want, (name, w._plan.num_items)
                if name == "ragged" and backend == "tensor-core" and kv_dtype == torch.bfloat16:
                    assert want, "the main config's ragged batch should take a piece plan"
            else:
                assert w._plan.pieces, (name, w._plan.num_items)
            if graph and w._plan.pieces:
                assert w._spread == 0  # piece plans keep the blockIdx launch
            ro, rl = batch_decode_reference(q, cache, *tables, return_lse=True, **scales,
                                            window_left=opts.get("window_left", -1))
            if graph and g is None:
                w.run(q, cache, out=out, lse=lse, **scales)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    w.run(q, cache, out=out, lse=lse, **scales)
            for r in range(2):
                out.fill_(float("nan"))
                if graph:
                    g.replay()
                else:
                    w.run(q, cache, out=out, lse=lse, **scales)
                testing.assert_close(out, ro, dtype=torch.bfloat16, msg=f"{name} run {r}: ")
                testing.assert_close(lse, rl, **LSE_TOL)
            torch.cuda.synchronize()
            if w._counters is not None:
                assert not w._counters.any(), f"{name}: arrival counters left {w._counters.nonzero()}"
    finally:
        decode_planner.PIECE_WAVES = None


@KERNELS
@pytest.mark.parametrize("tables", ["host", "device", "graph_host", "graph_in_buf"])
def test_pdl_chain_reads_the_previous_steps_output(backend, tables):
    """A chain of decode steps, each taking the previous step's output as its q. On sm_90 a decode
    grid launches with PDL and reads its plan (and the page tables plan() wrote) while the
    previous kernel, the previous step's merge (which signals at its top) or decode grid, still
    runs: q, K/V and out must be touched only after its wait. The outputs are poisoned before the
    chain, so a q read too early shows. Covers user tables read after the wait (device tables,
    page ids in the graph buffer) and enable_pdl=False (the same bits)."""
    ps, hq, hkv, d, max_pages, steps = 16, 32, 8, 128, 1024, 6
    lens = [30, 5000, 1, 700]  # split and unsplit requests: the steps end in the merge kernel
    cache = testing.randn((max_pages, 2, ps, hkv, d), torch.bfloat16, DEV, seed=1)
    indptr, indices, last = _graph_tables(lens, ps, max_pages, seed=5)
    q0 = testing.randn((len(lens), hq, d), torch.bfloat16, DEV, seed=2)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    graph = tables.startswith("graph")
    if graph:
        bufs = (torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEV),
                torch.zeros(max_pages, dtype=torch.int32, device=DEV),
                torch.zeros(len(lens), dtype=torch.int32, device=DEV))
        w = BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
                                               paged_kv_indices_buffer=bufs[1],
                                               paged_kv_last_page_len_buffer=bufs[2], backend=backend)
        ids = indices
        if tables == "graph_in_buf":
            bufs[1][: indices.numel()].copy_(indices)
            ids = bufs[1]
        w.plan(indptr, ids, last, hq, hkv, d, ps, q_data_type=torch.bfloat16)
        w.plan(indptr, ids, last, hq, hkv, d, ps, q_data_type=torch.bfloat16)  # the staged path too
    else:
        w = BatchDecodeWithPagedKVCacheWrapper(ws, backend=backend)
        t = (indptr, indices, last) if tables == "host" else (indptr.to(DEV), indices.to(DEV), last.to(DEV))
        w.plan(*t, hq, hkv, d, ps, q_data_type=torch.bfloat16)
    assert w._plan.split
    outs = [torch.empty_like(q0) for _ in range(steps)]

    def chain(**kw):
        q = q0
        for o in outs:
            w.run(q, cache, out=o, **kw)
            q = o

    for kw in ({}, {"enable_pdl": False}):
        if graph:
            chain(**kw)  # warm-up outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain(**kw)
        for o in outs:
            o.fill_(float("nan"))
        if graph:
            g.replay()
        else:
            chain(**kw)
        torch.cuda.synchronize()
        q = q0
        for i, o in enumerate(outs):
            ref = batch_decode_reference(q, cache, indptr, indices, last)
            testing.assert_close(o, ref, dtype=torch.bfloat16, msg=f"step {i} {kw}: ")
            q = o
        if not kw:
            first = [o.clone() for o in outs]
    for a, b in zip(first, outs):
        assert torch.equal(a, b)  # with and without PDL: the same kernel, the same bits


@KERNELS
def test_capture_without_graph_mode_raises(backend):
    """A wrapper built without use_cuda_graph refuses capture: on the launch path its launcher
    tests the stream (REFUSE_CAPTURE) and queues nothing, on the checked path (return_lse) torch's
    query does; afterwards the wrapper runs as before."""
    cache, indptr, indices, last = make_batch([64, 3000], 16, 8, 128)
    q = testing.randn((2, 32, 128), torch.bfloat16, DEV)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV), backend=backend)
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    w.run(q, cache, out=out)  # the first sight of the cache: checked path
    ref = w.run(q, cache).clone()  # launch path
    for kw in ({"out": out}, {"return_lse": True}):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(InputError, match="use_cuda_graph"):
            with torch.cuda.graph(g):
                w.run(q, cache, **kw)
    torch.cuda.synchronize()
    assert torch.equal(w.run(q, cache), ref)
    testing.assert_close(ref, batch_decode_reference(q, cache, indptr, indices, last), dtype=torch.bfloat16)


@KERNELS
def test_grid_merge_counters_return_to_zero(backend):
    """Split requests are merged by their last work item (merge_in_grid): the arrival counters
    must be 0 after every launch, so that back-to-back runs, runs with a new q and re-plans with
    other chunk counts (the same counters, other totals) all merge correctly."""
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=DEV), backend=backend)
    for i, (lens, kw) in enumerate([([20000, 3, 9000], {}), ([20000, 3, 9000], dict(fixed_split_size=7)),
                                    ([5000, 33000], dict(fixed_split_size=100))]):
        cache, indptr, indices, last = make_batch(lens, 16, 8, 128, seed=60 + i)
        w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, **kw)
        assert w._plan.split
        for r in range(3):
            q = testing.randn((len(lens), 32, 128), torch.bfloat16, DEV, seed=70 + 3 * i + r)
            lse = testing.empty_poisoned((len(lens), 32), torch.float32, DEV)
            out = w.run(q, cache, lse=lse)
            ro, rl = batch_decode_reference(q, cache, indptr, indices, last, "NHD", return_lse=True)
            testing.assert_close(out, ro, dtype=torch.bfloat16, msg=f"plan {i} run {r}: ")
            testing.assert_close(lse, rl, **LSE_TOL)
            assert not w._counters.any(), f"plan {i} run {r}: arrival counters left {w._counters.nonzero()}"


def test_deterministic():
    lens = [20000, 3]
    cache, indptr, indices, last = make_batch(lens, 16, 8, 128)
    q = testing.randn((2, 32, 128), torch.bfloat16, DEV)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV))
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    assert torch.equal(w.run(q, cache), w.run(q, cache))


def test_cuda_graph_wrapper_class():
    ps, max_pages = 16, 64
    cache = testing.randn((max_pages, 2, ps, 8, 128), torch.bfloat16, DEV, seed=1)
    q = testing.randn((2, 32, 128), torch.bfloat16, DEV, seed=2)
    bufs = (torch.zeros(3, dtype=torch.int32, device=DEV), torch.zeros(max_pages, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int32, device=DEV))
    w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV), *bufs)
    tables = _graph_tables([100, 7], ps, max_pages, seed=1)
    w.plan(*tables, 32, 8, 128, ps, q_data_type=torch.bfloat16)
    testing.assert_close(w.run(q, cache), batch_decode_reference(q, cache, *tables), dtype=torch.bfloat16)


@KERNELS
def test_merge_of_every_slot_count_up_to_18(backend):
    # request k has k + 1 chunks of 16 tokens: the merge sees 1 (no split) .. 18 partials,
    # covering every remainder of a warp's 8-slot load group and 1..3 of the CTA's 4 warps
    lens = [16 * k + 1 for k in range(18)]
    out, lse, ro, rl, w = run_decode(lens, 16, 32, 8, 128, plan_kw=dict(fixed_split_size=1), backend=backend)
    assert w._plan.split and w._plan.num_slots == sum(k + 1 for k in range(1, 18))
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    testing.assert_close(lse, rl, **LSE_TOL)


@KERNELS
def test_merge_of_long_slot_lists(backend):
    # 31 .. 100 partials per request: the merge's 4 warps take 8 slots each per turn of 32, so
    # these cover one full turn, a second turn for some warps only, and several turns
    counts = [31, 32, 33, 40, 64, 65, 100]
    lens = [16 * (c - 1) + 1 for c in counts]
    out, lse, ro, rl, w = run_decode(lens, 16, 32, 8, 128, plan_kw=dict(fixed_split_size=1), backend=backend)
    assert w._plan.split and w._plan.num_slots == sum(counts)
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    testing.assert_close(lse, rl, **LSE_TOL)


@KERNELS
def test_module_planner_makes_the_python_planners_plans(backend):
    # fi_plan_decode as the module exports it (nvcc's host compiler) against planner.plan_decode on
    # random ragged tables: the plan every non-uniform plan() stages; then one such batch end to end
    import numpy as np  # noqa: PLC0415
    from fi_attention.decode.planner import kv_lengths, plan_decode  # noqa: PLC0415
    out, lse, ro, rl, w = run_decode(lengths(7, 3000, seed=3), 16, 32, 8, 128, backend=backend)
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    (o,) = w._options.values()
    ctas, sm = o.kernel[3:5]
    planner = o.planner
    assert planner is not None and planner._fn is not None  # the module's export, not the fallback
    rng = np.random.default_rng(5)
    for _ in range(300):
        batch = int(rng.integers(1, 300))
        lens = rng.integers(0, int(rng.choice([500, 8192, 100000])), size=batch)
        pages = (lens + 15) // 16
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        last = np.where(pages > 0, lens - (pages - 1) * 16, 0).astype(np.int32)
        got = planner(indptr, last)
        want = plan_decode(kv_lengths(indptr, last, 16), kv_units=8, sm_count=sm, ctas_per_sm=ctas,
                           pieces=o.kernel[5])
        assert (got.chunk, got.num_items, got.num_slots, got.pieces) == \
            (want.chunk, want.num_items, want.num_slots, want.pieces)
        assert np.array_equal(got.packed, want.packed)


@pytest.mark.parametrize("lens", [[4096], [32768], [300, 200, 100, 77], [4096] * 64],
                         ids=["b1k4", "b1k32", "ragged_short", "b64k4"])
def test_sm90_streams_16bit_caches_through_the_ring(lens):
    # on sm_90 the default tensor-core module of a 16-bit cache is the shared-memory ring built
    # for 2 CTAs per SM (spec.RING_16BIT_CTAS), for short and long plans alike (CUDA-graph
    # wrappers load modules the same way); elsewhere register tiles at 3
    sm90 = arch_of(torch.device(DEV)).major >= 9
    out, lse, ro, rl, w = run_decode(lens, 16, 32, 8, 128)
    assert w._kernel_name.endswith("_mma_ctas2_mma_variant3") == sm90, w._kernel_name
    (o,) = w._options.values()
    if sm90:
        assert o.kernel[3] == decode_spec.RING_16BIT_CTAS  # resident CTAs per SM (occupancy query)
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    testing.assert_close(lse, rl, **LSE_TOL)


@KERNELS
def test_uniform_batch_split_to_whole_waves(backend):
    # 64 x 4096 tokens x 8 kv heads: the planner splits to avoid a partial last wave on big GPUs
    out, lse, ro, rl, w = run_decode([4096] * 64, 16, 32, 8, 128, backend=backend)
    testing.assert_close(out, ro, dtype=torch.bfloat16)
    testing.assert_close(lse, rl, **LSE_TOL)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@KERNELS
def test_fp8_tile_edges_with_window(kv_dtype, backend):
    # fp8 warps take two 16-token tiles per step: lengths around 16/32/48 and a window whose
    # start is not tile-aligned put the end of a range inside tile 0, tile 1 or past both
    lens = [1, 16, 17, 31, 32, 33, 47, 48, 49, 95, 1000]
    for wl in (-1, 40):
        out, lse, ro, rl, _ = run_decode(lens, 16, 32, 8, 128, kv_dtype=kv_dtype,
                                         run_kw=dict(k_scale=0.5, v_scale=2.0, window_left=wl),
                                         ref_kw=dict(k_scale=0.5, v_scale=2.0, window_left=wl),
                                         backend=backend, seed=wl + 2)
        testing.assert_close(out, ro, dtype=torch.bfloat16, msg=f"window_left {wl}: ")
        testing.assert_close(lse, rl, **LSE_TOL)


def test_run_after_switching_cache_refreshes_the_arguments():
    # run() skips re-writing the K/V fields when the cache is the previous call's: a different
    # cache (another layer) must still be read
    cache_a, indptr, indices, last = make_batch([300, 40], 16, 8, 128, seed=0)
    cache_b = make_batch([300, 40], 16, 8, 128, seed=9)[0]
    q = testing.randn((2, 32, 128), torch.bfloat16, DEV, seed=4)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV))
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    for cache in (cache_a, cache_a, cache_b, cache_a, (cache_b[:, 0].clone(), cache_b[:, 1].clone())):
        out = w.run(q, cache)
        ro = batch_decode_reference(q, cache, indptr, indices, last)
        testing.assert_close(out, ro, dtype=torch.bfloat16)


# The default path builds one variant of the tensor-core kernel per GPU and cache (spec.mma_variant:
# sm_90 streams every cache through the per-warp cp.async ring in shared memory, FI_MMA_VARIANT=3;
# other GPUs keep register tiles, variant 0, for 16-bit caches). These cases build the variants
# explicitly (the ring at its default depth and at 1 slot per warp, and register tiles) and check
# them against the reference: every KV layout (16-bit/fp8 x head_dim 64/128, so 256-, 128- and
# 64-byte rows), 1/4/8 query heads per CTA, soft cap with ALiBi, a window, page sizes 1/5/16,
# and lengths around the ring's edges (a warp takes 16 tokens per slot, 64 per round of 4 warps;
# the default ring is 2 slots at bf16 d128 up to 6 at fp8 d64; fp8 register tiles take 32 tokens
# per step) plus split requests.
_BF, _HF, _E4, _E5 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
RING_CASES = [  # (id, q dtype, kv dtype, head_dim, hq, hkv, page size, plan options)
    ("bf16_d128_gh4", _BF, _BF, 128, 32, 8, 16, {}),
    ("e4m3_d128_gh8_window", _BF, _E4, 128, 32, 4, 16, dict(window_left=40)),
    ("f16_d64_gh8_page1", _HF, _HF, 64, 16, 2, 1, {}),
    ("e5m2_d64_gh4_page5", _HF, _E5, 64, 32, 8, 5, {}),
    ("bf16_d128_gh1_softcap_alibi", _BF, _BF, 128, 8, 8, 16,
     dict(logits_soft_cap=30.0, pos_encoding_mode="ALIBI")),
]
RING_LENS = [1, 15, 16, 17, 63, 64, 65, 129, 257, 520, 1031, 6000]


@pytest.fixture(params=[(3, 0), (3, 1), (0, 0)], ids=["ring", "ring_stages_1", "register_tiles"])
def mma_variant(request):
    """Builds select the given (variant, ring slots) modules while the test runs (the module
    cache of the wrapper is keyed on spec.py's switches, and emptied on both sides)."""
    saved = decode_spec.MMA_VARIANT, decode_spec.MMA_STAGES
    decode_spec.MMA_VARIANT, decode_spec.MMA_STAGES = request.param
    decode_spec.decode_mma_spec.cache_clear()
    decode_batch._MODULE_CACHE.clear()
    arch = arch_of(torch.device(DEV))
    build_many(sorted({decode_spec.decode_mma_spec(q, kv, d, hq // hkv, kw.get("pos_encoding_mode", "NONE"),
                                                   "logits_soft_cap" in kw, arch)
                       for _, q, kv, d, hq, hkv, _, kw in RING_CASES}, key=lambda sp: sp.name))
    yield request.param[0]
    decode_spec.MMA_VARIANT, decode_spec.MMA_STAGES = saved
    decode_spec.decode_mma_spec.cache_clear()
    decode_batch._MODULE_CACHE.clear()


@pytest.mark.parametrize("case", RING_CASES, ids=[c[0] for c in RING_CASES])
def test_mma_variants(case, mma_variant):
    _, q_dtype, kv_dtype, d, hq, hkv, ps, plan_kw = case
    run_kw = dict(k_scale=0.5, v_scale=2.0) if kv_dtype in (_E4, _E5) else {}
    for split in (dict(fixed_split_size=7), {}):
        out, lse, ro, rl, w = run_decode(RING_LENS, ps, hq, hkv, d, q_dtype=q_dtype, kv_dtype=kv_dtype,
                                         plan_kw={**plan_kw, **split}, run_kw=run_kw,
                                         ref_kw={**plan_kw, **run_kw}, backend="tensor-core")
        assert ("mma_variant3" in w._kernel_name) == (mma_variant == 3), w._kernel_name
        testing.assert_close(out, ro, dtype=q_dtype, msg=f"{split}: ")
        testing.assert_close(lse, rl, **LSE_TOL)

"""GPU tests for the RoPE kernel against the reference (run on the GPU with the same fp32 angles).

Positions go up to ~1e6 so the fp64 range reduction is exercised. Grid reduction: all head dims
and head layouts at nnz 1 and 7; nnz 4097 only for three (heads, head_dim) pairs, which covers
multi-wave launches and the head-group split without 4097 x 256-wide copies to the host for every
combination. Outputs of out-of-place calls are poisoned (NaN) through the destination-passing core.
"""

import pytest
import torch

from fi_core import knobs, testing
from fi_sampling import rope
from fi_sampling.rope import api
from fi_sampling.rope.reference import rope_reference

pytestmark = testing.gpu_only()

DEV = "cuda"
DTYPES = (torch.float16, torch.bfloat16)


def _qk(nnz, hq, hk, d, dtype, seed=0):
    return (testing.randn((nnz, hq, d), dtype, DEV, seed=seed),
            testing.randn((nnz, hk, d), dtype, DEV, seed=seed + 1))


def _pos(nnz, dtype, high=1 << 20, seed=7):
    return torch.randint(0, high, (nnz,), generator=testing.generator(seed)).to(DEV, dtype)


def _core(q, k, q_out, k_out, *, pos_ids=None, indptr=None, offsets=None, cache=None,
          head_size=0, rotary_dim, interleave, scale=1.0, theta=1e4, llama=None):
    low, high, old = llama or (1.0, 4.0, 8192.0)
    api._rope_dispatch(q, k, q_out, k_out, pos_ids, indptr, offsets, cache, head_size,
                       rotary_dim, interleave, scale, theta, llama is not None, low, high, old)


def _close(got, want, msg=""):
    testing.assert_close(got, want, dtype=want.dtype, msg=msg)


def test_dispatch_picks_the_kernel():
    # Otherwise every test below would compare the reference with itself.
    for dtype in DTYPES:
        assert api._backend(torch.device(DEV, torch.cuda.current_device()), dtype) == "cuda"
    assert api._backend(torch.device(DEV, torch.cuda.current_device()), torch.float32) == "reference"


_SHAPES = [(n, hq, hk, d) for n in (1, 7) for hq, hk in ((32, 8), (7, 1)) for d in (64, 128, 256)]
_SHAPES += [(4097, 32, 8, 128), (4097, 7, 1, 256), (4097, 7, 1, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("nnz,hq,hk,d", _SHAPES)
def test_pos_ids_matches_reference(nnz, hq, hk, d, interleave, dtype):
    q, k = _qk(nnz, hq, hk, d, dtype)
    pos = _pos(nnz, torch.int64 if interleave == (dtype == torch.bfloat16) else torch.int32)
    qo = testing.empty_poisoned(q.shape, dtype, DEV)
    ko = testing.empty_poisoned(k.shape, dtype, DEV)
    _core(q, k, qo, ko, pos_ids=pos, rotary_dim=d, interleave=interleave)
    rq, rk = rope_reference(q, k, pos_ids=pos, interleave=interleave)
    _close(qo, rq, "q: ")
    _close(ko, rk, "k: ")
    # deterministic: the same call again is bit-identical
    qo2, ko2 = rope.apply_rope_pos_ids(q, k, pos, interleave=interleave)
    assert torch.equal(qo2, qo) and torch.equal(ko2, ko)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("d,rd", [(128, 64), (128, 32), (256, 96), (80, 32), (64, 24), (64, 6)])
def test_partial_rotary(d, rd, interleave, inplace):
    # (64, 24) and (64, 6) force 8-byte and 2-byte accesses (rotary_dim/2 = 12 and 3).
    dtype = torch.bfloat16
    q, k = _qk(37, 7, 1, d, dtype, seed=3)
    pos = _pos(37, torch.int64, high=70000)
    rq, rk = rope_reference(q, k, pos_ids=pos, rotary_dim=rd, interleave=interleave)
    if inplace:
        q0, k0 = q.clone(), k.clone()
        rope.apply_rope_pos_ids_inplace(q, k, pos, rotary_dim=rd, interleave=interleave)
        assert torch.equal(q[..., rd:], q0[..., rd:]) and torch.equal(k[..., rd:], k0[..., rd:])
        qo, ko = q, k
    else:
        qo = testing.empty_poisoned(q.shape, dtype, DEV)
        ko = testing.empty_poisoned(k.shape, dtype, DEV)
        _core(q, k, qo, ko, pos_ids=pos, rotary_dim=rd, interleave=interleave)
        assert torch.equal(qo[..., rd:], q[..., rd:]) and torch.equal(ko[..., rd:], k[..., rd:])
    _close(qo, rq, "q: ")
    _close(ko, rk, "k: ")


@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("idx", [(torch.int32, torch.int32), (torch.int64, torch.int64),
                                 (torch.int32, torch.int64)])
def test_ragged_indptr_offsets(idx, interleave, llama):
    dtype = torch.float16
    lengths = [3, 0, 3997, 1, 96]  # an empty request in the middle
    nnz = sum(lengths)
    indptr = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=idx[0], device=DEV)
    offsets = torch.tensor([5, 123, 0, 999_999, 40_000], dtype=idx[1], device=DEV)
    q, k = _qk(nnz, 32, 8, 128, dtype, seed=11)
    kw = dict(rope_scale=8.0, rope_theta=5e5, llama31=(1.0, 4.0, 8192.0)) if llama else {}
    rq, rk = rope_reference(q, k, indptr=indptr, offsets=offsets, interleave=interleave, **kw)
    if llama:
        qo, ko = rope.apply_llama31_rope(q, k, indptr, offsets, interleave=interleave)
    else:
        qo, ko = rope.apply_rope(q, k, indptr, offsets, interleave=interleave)
    _close(qo, rq, "q: ")
    _close(ko, rk, "k: ")
    fn = rope.apply_llama31_rope_inplace if llama else rope.apply_rope_inplace
    assert fn(q, k, indptr, offsets, interleave=interleave) is None
    assert torch.equal(q, qo) and torch.equal(k, ko)


def test_llama31_pos_ids_and_scale():
    q, k = _qk(300, 7, 1, 128, torch.bfloat16, seed=5)
    pos = _pos(300, torch.int32)
    rq, rk = rope_reference(q, k, pos_ids=pos, rope_scale=8.0, rope_theta=5e5,
                            llama31=(1.0, 4.0, 8192.0), rotary_dim=64)
    qo, ko = rope.apply_llama31_rope_pos_ids(q, k, pos, rotary_dim=64)
    _close(qo, rq)
    _close(ko, rk)
    rq, _ = rope_reference(q, k, pos_ids=pos, rope_scale=2.5, rope_theta=1e6)
    rope.apply_rope_pos_ids_inplace(q, k, pos, rope_scale=2.5, rope_theta=1e6)
    _close(q, rq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rd", [128, 64])
def test_cos_sin_cache_on_fused_qkv(rd, neox, inplace, dtype):
    nnz, hq, hk, d, max_pos = 4097, 32, 8, 128, 5000
    qkv = testing.randn((nnz, (hq + 2 * hk) * d), dtype, DEV, seed=21)
    query, key = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d]  # row stride (hq + 2hk) * d
    v0 = qkv[:, (hq + hk) * d:].clone()
    cache = testing.randn((max_pos, rd), torch.float32, DEV, seed=22)  # any values: checks indexing
    pos = _pos(nnz, torch.int64 if neox else torch.int32, high=max_pos)
    rq, rk = rope_reference(query.view(nnz, hq, d), key.view(nnz, hk, d), pos_ids=pos,
                            cos_sin_cache=cache, interleave=not neox)
    if inplace:
        rope.apply_rope_with_cos_sin_cache_inplace(pos, query, key, d, cache, neox)
        qo, ko = query, key
        assert torch.equal(qkv[:, (hq + hk) * d:], v0)
    else:
        qo, ko = rope.apply_rope_with_cos_sin_cache(pos, query, key, d, cache, neox)
        assert qo.shape == query.shape
    _close(qo.reshape(nnz, hq, d), rq, "q: ")
    _close(ko.reshape(nnz, hk, d), rk, "k: ")


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("hq,hk,d,rd,dtype", [
    (5, 2, 128, 128, torch.bfloat16),  # 7 heads: the last head group of the cache kernel is partial
    (7, 2, 64, 24, torch.float16),     # rotary_dim / 2 = 12: 8-byte runs; tail copy out of place
    (3, 1, 80, 32, torch.bfloat16),    # 3 + 1 heads, 16-byte runs, 48-wide tail
    (7, 1, 64, 4, torch.bfloat16),     # rotary_dim / 2 = 2: 4-byte runs
    (7, 1, 64, 6, torch.float16),      # rotary_dim / 2 = 3: 2-byte runs (rope_kernel, not the cache kernel)
    (33, 7, 128, 64, torch.bfloat16),  # 40 heads but 33 q heads: head groups straddle q and k
])
def test_cos_sin_cache_edges(hq, hk, d, rd, dtype, neox, inplace):
    # Head counts and rotary widths that the bench shape (32/8 heads, rd 128) never reaches: every
    # access width of the cache kernel, partial head groups, and the tail copy of out-of-place calls.
    nnz, max_pos = 301, 700
    q, k = _qk(nnz, hq, hk, d, dtype, seed=51)
    cache = testing.randn((max_pos, rd), torch.float32, DEV, seed=52)
    pos = _pos(nnz, torch.int32 if neox else torch.int64, high=max_pos)
    rq, rk = rope_reference(q, k, pos_ids=pos, cos_sin_cache=cache, interleave=not neox)
    if inplace:
        q0, k0 = q.clone(), k.clone()
        rope.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cache, neox)
        assert torch.equal(q[..., rd:], q0[..., rd:]) and torch.equal(k[..., rd:], k0[..., rd:])
        qo, ko = q, k
    else:
        qo = testing.empty_poisoned(q.shape, dtype, DEV)
        ko = testing.empty_poisoned(k.shape, dtype, DEV)
        _core(q, k, qo, ko, pos_ids=pos, cache=cache, rotary_dim=rd, interleave=not neox)
        assert torch.equal(qo[..., rd:], q[..., rd:]) and torch.equal(ko[..., rd:], k[..., rd:])
    _close(qo, rq, "q: ")
    _close(ko, rk, "k: ")


def test_cache_position_out_of_range_gives_nan():
    q, k = _qk(4, 4, 1, 64, torch.bfloat16)
    cache = testing.randn((10, 64), torch.float32, DEV)
    pos = torch.tensor([0, 10, 3, -1], device=DEV)
    with knobs.override(FI_CHECK_INPUTS="0"):  # with checks on, this raises InputError instead
        qo, _ = rope.apply_rope_with_cos_sin_cache(pos, q.view(4, -1), k.view(4, -1), 64, cache)
    bad = qo.view(4, 4, 64).isnan().all(dim=(1, 2))
    assert bad.tolist() == [False, True, False, True]


@pytest.mark.parametrize("layout", ["qkv_slice", "padded_heads", "misaligned"])
@pytest.mark.parametrize("interleave", [False, True])
def test_non_contiguous_views(layout, interleave):
    nnz, hq, hk, d, dtype = 129, 8, 2, 128, torch.bfloat16
    if layout == "qkv_slice":
        buf = testing.randn((nnz, hq + 2 * hk, d), dtype, DEV, seed=31)
        q, k = buf[:, :hq], buf[:, hq:hq + hk]
    elif layout == "padded_heads":  # head stride d + 8: still 16-byte aligned
        q = testing.randn((nnz, hq, d + 8), dtype, DEV, seed=32)[..., :d]
        k = testing.randn((nnz, hk, d + 8), dtype, DEV, seed=33)[..., :d]
    else:  # 2-byte aligned base pointers: the kernel must fall back to narrow accesses
        q = testing.randn((nnz * hq * d + 1,), dtype, DEV, seed=34)[1:].view(nnz, hq, d)
        k = testing.randn((nnz * hk * d + 1,), dtype, DEV, seed=35)[1:].view(nnz, hk, d)
    pos = _pos(nnz, torch.int64)
    rq, rk = rope_reference(q, k, pos_ids=pos, interleave=interleave)
    qo = testing.empty_poisoned(q.shape, dtype, DEV)
    ko = testing.empty_poisoned(k.shape, dtype, DEV)
    _core(q, k, qo, ko, pos_ids=pos, rotary_dim=d, interleave=interleave)
    _close(qo, rq, "q: ")
    _close(ko, rk, "k: ")
    rope.apply_rope_pos_ids_inplace(q, k, pos, interleave=interleave)
    _close(q, rq, "q in place: ")
    _close(k, rk, "k in place: ")


def test_cuda_graph_replay_and_compile():
    q, k = _qk(64, 8, 2, 128, torch.bfloat16, seed=41)
    pos = _pos(64, torch.int32)
    qs, ks = q.clone(), k.clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        rope.apply_rope_pos_ids_inplace(qs, ks, pos)  # warm-up (module load) outside capture
        qs.copy_(q), ks.copy_(k)
        with torch.cuda.graph(g, stream=s):
            rope.apply_rope_pos_ids_inplace(qs, ks, pos)
    torch.cuda.synchronize()
    q2, k2 = _qk(64, 8, 2, 128, torch.bfloat16, seed=42)
    qs.copy_(q2), ks.copy_(k2)
    g.replay()
    torch.cuda.synchronize()
    rq, rk = rope_reference(q2, k2, pos_ids=pos)
    _close(qs, rq)
    _close(ks, rk)

    f = torch.compile(lambda q, k, p: rope.apply_rope_pos_ids(q, k, p, rotary_dim=64),
                      fullgraph=True, backend="aot_eager")
    qo, ko = f(q, k, pos)
    rq, rk = rope_reference(q, k, pos_ids=pos, rotary_dim=64)
    _close(qo, rq)
    _close(ko, rk)

"""GPU tests of the norm kernels against the fp32 reference (computed on the GPU too).

Grid reduction: hidden sizes {111, 4096, 8191, 16384} x batch {1, 7, 99} x both dtypes for every
variant, and batch 989 only with hidden 111 and 4096 (many row groups per block / many waves)
so the host-side comparison stays small. The launch plan switches kernels on (vector width,
vectors per thread): 111 and 8191 run 2-byte accesses (8191 fused falls back to the two-pass
loop kernel), 4096/16384 run 16-byte accesses, hidden 40000 and odd-stride 16384 rows hit the loop
kernel. Strided outputs live inside a NaN-poisoned buffer so stray writes show.
"""

import pytest
import torch

from fi_core import testing
from fi_sampling import norm
from fi_sampling.norm.reference import (
    fused_add_rmsnorm_reference, layernorm_reference, rmsnorm_reference,
)

pytestmark = testing.gpu_only()

DEV = "cuda"
DTYPES = (torch.float16, torch.bfloat16)
SHAPES = [(b, h) for h in (111, 4096, 8191, 16384) for b in (1, 7, 99)] + [(989, 111), (989, 4096)]


def _x(shape, dtype, seed):
    return testing.randn(shape, dtype, DEV, seed=seed, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm(rows, hidden, dtype, gemma):
    x = _x((rows, hidden), dtype, seed=rows + hidden)
    w = _x((hidden,), dtype, seed=1)
    out = testing.empty_poisoned((rows, hidden), dtype, DEV)
    fn = norm.gemma_rmsnorm if gemma else norm.rmsnorm
    fn(x, w, 1e-6, out=out)
    testing.assert_close(out, rmsnorm_reference(x, w, 1e-6, 1.0 if gemma else 0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm(rows, hidden, dtype, gemma):
    x = _x((rows, hidden), dtype, seed=rows)
    r = _x((rows, hidden), dtype, seed=hidden)
    w = _x((hidden,), dtype, seed=2)
    want_x, want_r = fused_add_rmsnorm_reference(x, r, w, 1e-5, 1.0 if gemma else 0.0)
    fn = norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm
    fn(x, r, w, 1e-5)
    assert torch.equal(r, want_r), "residual must be the input + residual sum rounded once"
    testing.assert_close(x, want_x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 111), (7, 4096), (99, 8191), (989, 1024), (5, 16384)])
def test_layernorm(rows, hidden, dtype):
    x = _x((rows, hidden), dtype, seed=3) + 1.5  # a non-zero mean exercises the centring
    g = testing.randn((hidden,), torch.float32, DEV, seed=4)
    b = testing.randn((hidden,), torch.float32, DEV, seed=5)
    testing.assert_close(norm.layernorm(x, g, b), layernorm_reference(x, g, b))


@pytest.mark.parametrize("offset", [1, 2, 4])
def test_layernorm_misaligned_params(offset):
    # gemma/beta are read as float vectors; a sliced (4/8/16-byte aligned) parameter must
    # narrow the access width, not fault or read the wrong columns.
    x = _x((9, 4096), torch.bfloat16, seed=14)
    g = testing.randn((4096 + 8,), torch.float32, DEV, seed=15)[offset: offset + 4096]
    b = testing.randn((4096 + 8,), torch.float32, DEV, seed=16)[offset: offset + 4096]
    testing.assert_close(norm.layernorm(x, g, b), layernorm_reference(x, g, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(3001, 8192), (200003, 128)])
def test_fused_add_rmsnorm_many_waves(rows, hidden, dtype):
    # Several waves of blocks: every block prefetches the rows of the block one wave later
    # (one row per 256-thread block at 8192; 32 rows per 128-thread block at 128), and the last
    # wave's blocks must skip rows past the end. Odd row counts leave a partial last block.
    x = _x((rows, hidden), dtype, seed=rows)
    r = _x((rows, hidden), dtype, seed=hidden)
    w = _x((hidden,), dtype, seed=3)
    want_x, want_r = fused_add_rmsnorm_reference(x, r, w, 1e-6)
    norm.fused_add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(r, want_r), "residual must be the input + residual sum rounded once"
    testing.assert_close(x, want_x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 32, 128), (99, 8, 128), (7, 5, 111), (33, 4, 256)])
def test_qk_norm_3d_from_fused_qkv(tokens, heads, head_dim, dtype):
    # q and k sliced out of one [tokens, (hq + 2 hk) * d] tensor: row stride != heads * head_dim.
    qkv = _x((tokens, 3 * heads * head_dim), dtype, seed=6)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: 2 * heads * head_dim].view(tokens, heads, head_dim)
    w = _x((head_dim,), dtype, seed=7)
    out = testing.empty_poisoned((tokens, heads, head_dim), dtype, DEV)
    norm.rmsnorm(q, w, out=out)
    testing.assert_close(out, rmsnorm_reference(q, w))
    want_k = rmsnorm_reference(k, w)
    norm.rmsnorm(k, w, out=k)  # in place on a strided view
    testing.assert_close(k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,stride", [(7, 4096, 4096 + 64), (99, 111, 200), (5, 16384, 16385),
                                                (3, 40000, 40000)])
def test_strided_rows_and_stray_writes(rows, hidden, stride, dtype):
    xbuf = _x((rows, stride), dtype, seed=8)
    x = xbuf[:, :hidden]
    w = _x((hidden,), dtype, seed=9)
    obuf = testing.empty_poisoned((rows, stride + 8), dtype, DEV)
    out = obuf[:, 8: 8 + hidden]
    norm.rmsnorm(x, w, out=out)
    testing.assert_close(out, rmsnorm_reference(x, w))
    assert torch.isnan(obuf[:, :8]).all() and torch.isnan(obuf[:, 8 + hidden:]).all(), "stray write"
    # fused add on strided rows: residual in its own padded buffer
    rbuf = _x((rows, stride), dtype, seed=10)
    r = rbuf[:, :hidden]
    want_x, want_r = fused_add_rmsnorm_reference(x, r, w)
    norm.fused_add_rmsnorm(x, r, w)
    assert torch.equal(r, want_r)
    testing.assert_close(x, want_x)
    assert torch.equal(xbuf[:, hidden:], _x((rows, stride), dtype, seed=8)[:, hidden:]), "stray write"


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_and_in_place(dtype):
    x = _x((99, 8192), dtype, seed=11)
    w = _x((8192,), dtype, seed=12)
    a, b = norm.rmsnorm(x, w), norm.rmsnorm(x, w)
    assert torch.equal(a, b)
    y = x.clone()
    norm.rmsnorm(y, w, out=y)
    assert torch.equal(y, a)


def test_empty_batch_is_a_no_op():
    x = torch.empty(0, 4096, dtype=torch.bfloat16, device=DEV)
    w = _x((4096,), torch.bfloat16, seed=13)
    assert norm.rmsnorm(x, w).shape == (0, 4096)
    norm.fused_add_rmsnorm(x, x.clone(), w)

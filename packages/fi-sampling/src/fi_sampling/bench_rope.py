"""RoPE benchmark routines (shared/TARGETS.md): 8192 tokens, 32 q / 8 kv heads, head_dim 128, bf16.

`flashinfer bench --routine apply_rope_with_cos_sin_cache_inplace` and `--routine
apply_rope_pos_ids`. Each checks correctness against the reference first, then times ours and an
eager torch implementation on the same L2-rotated inputs. Bytes = q and k read once and written
once, plus the positions and (cache variant) the gathered cache rows.
"""

from __future__ import annotations

import torch

from fi_core import testing
from fi_core.bench import BenchRow, RoutineArgs, apply_tuning, rotating_inputs, routine, time_fn

from .rope import apply_rope_pos_ids, apply_rope_with_cos_sin_cache_inplace
from .rope import spec as rope_spec_module
from .rope.reference import cos_sin_from_positions, rope_frequencies, rope_reference

NNZ, HQ, HK, D = 8192, 32, 8, 128
MAX_POS = 8192


def _qk(i: int, dev, dtype=torch.bfloat16):
    q = testing.randn((NNZ, HQ, D), dtype, dev, seed=3 * i)
    k = testing.randn((NNZ, HK, D), dtype, dev, seed=3 * i + 1)
    pos = torch.randint(0, MAX_POS, (NNZ,), generator=testing.generator(3 * i + 2)).to(dev)
    return q, k, pos


def _torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eager NeoX rotation in fp32 over [nnz, H, D] with cos/sin [nnz, D/2]."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _torch_cache_inplace(pos, query, key, head_size, cache):
    half = cache.shape[1] // 2
    rows = cache[pos]
    cos, sin = rows[:, :half], rows[:, half:]
    for x in (query, key):
        xv = x.view(x.shape[0], -1, head_size)
        xv.copy_(_torch_rotate(xv, cos, sin))


def _torch_pos_ids(q, k, pos, freqs):
    angle = pos.float()[:, None] * freqs[None, :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    return _torch_rotate(q, cos, sin), _torch_rotate(k, cos, sin)


def _bytes(cache_rows: bool) -> float:
    qk = NNZ * (HQ + HK) * D * 2
    return 2 * qk + NNZ * 8 + (NNZ * D * 4 if cache_rows else 0)


@routine("apply_rope_with_cos_sin_cache_inplace", family="fi-sampling",
         help="in-place RoPE from a float32 cos/sin cache vs eager torch")
def bench_rope_cos_sin_cache_inplace(args: RoutineArgs):
    dev = torch.device(args.device)
    # A/B: variant=N builds the cos/sin-cache kernel with FI_ROPE_CACHE_VARIANT=N
    config = f"nnz={NNZ} heads={HQ}/{HK} d={D} bf16 neox" + apply_tuning(
        args, rope_spec_module, {"variant": "CACHE_VARIANT"}, rope_spec_module.rope_spec)
    freqs = rope_frequencies(D, 1.0, 1e4, device=dev)
    cos, sin = cos_sin_from_positions(torch.arange(MAX_POS, device=dev), freqs)
    cache = torch.cat((cos, sin), dim=1).contiguous()

    q, k, pos = _qk(0, dev)
    q2, k2 = q.reshape(NNZ, HQ * D).clone(), k.reshape(NNZ, HK * D).clone()
    apply_rope_with_cos_sin_cache_inplace(pos, q2, k2, D, cache, True)
    rq, rk = rope_reference(q, k, pos_ids=pos, cos_sin_cache=cache)
    testing.assert_close(q2.view(NNZ, HQ, D), rq, msg="q: ")
    testing.assert_close(k2.view(NNZ, HK, D), rk, msg="k: ")

    def make(i):
        q, k, pos = _qk(i, dev)
        return pos, q.view(NNZ, HQ * D), k.view(NNZ, HK * D)

    sets = rotating_inputs(make, dev)
    ours = time_fn(lambda p, q, k: apply_rope_with_cos_sin_cache_inplace(p, q, k, D, cache, True), sets)
    base = time_fn(lambda p, q, k: _torch_cache_inplace(p, q, k, D, cache), sets)
    yield BenchRow("apply_rope_with_cos_sin_cache_inplace", config, ours, bytes=_bytes(True),
                   baseline=("torch eager (gather cache, rotate, copy back)", base),
                   target_us=45.0, backend="cuda")


@routine("apply_rope_pos_ids", family="fi-sampling",
         help="out-of-place RoPE with computed angles vs eager torch")
def bench_rope_pos_ids(args: RoutineArgs):
    dev = torch.device(args.device)
    freqs = rope_frequencies(D, 1.0, 1e4, device=dev)

    q, k, pos = _qk(0, dev)
    oq, ok = apply_rope_pos_ids(q, k, pos)
    rq, rk = rope_reference(q, k, pos_ids=pos)
    testing.assert_close(oq, rq, msg="q: ")
    testing.assert_close(ok, rk, msg="k: ")

    sets = rotating_inputs(lambda i: _qk(i, dev), dev)
    ours = time_fn(lambda q, k, p: apply_rope_pos_ids(q, k, p), sets)
    base = time_fn(lambda q, k, p: _torch_pos_ids(q, k, p, freqs), sets)
    yield BenchRow("apply_rope_pos_ids", f"nnz={NNZ} heads={HQ}/{HK} d={D} bf16 neox", ours,
                   bytes=_bytes(False), baseline=("torch eager (cos/sin from pos, rotate)", base),
                   target_us=60.0, backend="cuda")

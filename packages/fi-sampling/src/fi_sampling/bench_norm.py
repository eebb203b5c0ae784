"""Norm and gated-activation benchmark routines (shared/TARGETS.md, H200, bf16).

`flashinfer bench --routine rmsnorm | fused_add_rmsnorm | silu_and_mul | gemma_rmsnorm |
layernorm | gelu_and_mul`. Each routine checks correctness against the fp32 reference first,
then times ours and the torch baseline on the same L2-rotated inputs. Bytes are the floor: every
tensor read or written once (the weight once per call, not per row); FLOPs count the arithmetic
per element (square-accumulate, scale, weight; exp/div of the activation as one op each).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fi_core import testing
from fi_core.bench import BenchRow, RoutineArgs, apply_tuning, rotating_inputs, routine, time_fn

from .activation import gelu_and_mul, silu_and_mul
from .activation.reference import act_and_mul_reference
from .norm import fused_add_rmsnorm, gemma_rmsnorm, layernorm, rmsnorm
from .norm import spec as norm_spec_module
from .norm.reference import fused_add_rmsnorm_reference, layernorm_reference, rmsnorm_reference

DT = torch.bfloat16
ES = 2  # bytes per bf16 element
TOKENS, HIDDEN = 8192, 8192
INTER = 14336  # silu_and_mul: [8192, 2 * 14336] -> [8192, 14336] (Llama-3 70B MLP)


CHECK_ROWS = 256  # rows compared in detail on the host (fp64 on the CPU); all rows on the GPU


def _x(shape, dev, seed):
    return testing.randn(shape, DT, dev, seed=seed)


def _check(got, want, msg=""):
    atol, rtol = testing.tolerance(got.dtype)
    g, e = got.float(), want.float()
    bad = int((~((g - e).abs() <= atol + rtol * e.abs())).sum())
    if bad:
        raise AssertionError(f"{msg}{bad}/{got.numel()} elements outside atol={atol} rtol={rtol}")
    testing.assert_close(got[:CHECK_ROWS], want[:CHECK_ROWS], msg=msg)


def _rms_bytes(fused: bool) -> float:
    rowdata = TOKENS * HIDDEN * ES
    return (4 if fused else 2) * rowdata + HIDDEN * ES


def _torch_rmsnorm(x, w, eps=1e-6):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


@routine("rmsnorm", family="fi-sampling", help="rmsnorm 8192x8192 bf16 vs torch F.rms_norm")
def bench_rmsnorm(args: RoutineArgs):
    dev = torch.device(args.device)
    x, w = _x((TOKENS, HIDDEN), dev, 0), _x((HIDDEN,), dev, 1)
    _check(rmsnorm(x, w), rmsnorm_reference(x, w))
    sets = rotating_inputs(lambda i: (_x((TOKENS, HIDDEN), dev, i), w), dev)
    ours = time_fn(lambda x, w: rmsnorm(x, w), sets)
    base = time_fn(_torch_rmsnorm, sets)
    yield BenchRow("rmsnorm", f"{TOKENS}x{HIDDEN} bf16", ours, bytes=_rms_bytes(False),
                   flops=4.0 * TOKENS * HIDDEN, baseline=("torch F.rms_norm", base),
                   target_us=70.0, backend="cuda")


@routine("gemma_rmsnorm", family="fi-sampling", help="gemma_rmsnorm 8192x8192 bf16 vs eager torch")
def bench_gemma_rmsnorm(args: RoutineArgs):
    dev = torch.device(args.device)
    x, w = _x((TOKENS, HIDDEN), dev, 0), _x((HIDDEN,), dev, 1)
    _check(gemma_rmsnorm(x, w), rmsnorm_reference(x, w, 1e-6, 1.0))
    sets = rotating_inputs(lambda i: (_x((TOKENS, HIDDEN), dev, i), w), dev)
    ours = time_fn(lambda x, w: gemma_rmsnorm(x, w), sets)
    base = time_fn(lambda x, w: _torch_rmsnorm(x, 1.0 + w), sets)
    yield BenchRow("gemma_rmsnorm", f"{TOKENS}x{HIDDEN} bf16", ours, bytes=_rms_bytes(False),
                   flops=5.0 * TOKENS * HIDDEN, baseline=("torch F.rms_norm(x, 1 + w)", base),
                   target_us=70.0, backend="cuda")


def _torch_fused(x, r, w, eps=1e-6):
    r.add_(x)
    x.copy_(F.rms_norm(r, (r.shape[-1],), w, eps))


@routine("fused_add_rmsnorm", family="fi-sampling",
         help="fused_add_rmsnorm 8192x8192 bf16 (in place) vs eager torch add + F.rms_norm")
def bench_fused_add_rmsnorm(args: RoutineArgs):
    dev = torch.device(args.device)
    # A/B: fused_nv=N builds the kernel with FI_FUSED_NV=N (vectors per thread it starts from)
    config = f"{TOKENS}x{HIDDEN} bf16" + apply_tuning(args, norm_spec_module, {"fused_nv": "FUSED_NV"},
                                                       norm_spec_module.norm_spec)
    x, r, w = _x((TOKENS, HIDDEN), dev, 0), _x((TOKENS, HIDDEN), dev, 1), _x((HIDDEN,), dev, 2)
    want_x, want_r = fused_add_rmsnorm_reference(x, r, w)
    fused_add_rmsnorm(x, r, w)
    assert torch.equal(r, want_r), "fused_add_rmsnorm: residual differs from the rounded sum"
    _check(x, want_x)
    # In place: repeated calls keep growing the residual by one normalised row each time, which
    # stays far from bf16 overflow for the few hundred calls timed here.
    sets = rotating_inputs(lambda i: (_x((TOKENS, HIDDEN), dev, 2 * i),
                                      _x((TOKENS, HIDDEN), dev, 2 * i + 1), w), dev)
    ours = time_fn(lambda x, r, w: fused_add_rmsnorm(x, r, w), sets)
    base = time_fn(_torch_fused, sets)
    yield BenchRow("fused_add_rmsnorm", config, ours, bytes=_rms_bytes(True),
                   flops=5.0 * TOKENS * HIDDEN, baseline=("torch add_ + F.rms_norm + copy_", base),
                   target_us=130.0, backend="cuda")


@routine("layernorm", family="fi-sampling", help="layernorm 8192x8192 bf16 vs torch F.layer_norm")
def bench_layernorm(args: RoutineArgs):
    dev = torch.device(args.device)
    x = _x((TOKENS, HIDDEN), dev, 0)
    g = testing.randn((HIDDEN,), torch.float32, dev, seed=1)
    b = testing.randn((HIDDEN,), torch.float32, dev, seed=2)
    _check(layernorm(x, g, b), layernorm_reference(x, g, b))
    gb, bb = g.to(DT), b.to(DT)  # F.layer_norm needs parameters in the input dtype
    sets = rotating_inputs(lambda i: (_x((TOKENS, HIDDEN), dev, i),), dev)
    ours = time_fn(lambda x: layernorm(x, g, b), sets)
    base = time_fn(lambda x: F.layer_norm(x, (HIDDEN,), gb, bb, 1e-6), sets)
    yield BenchRow("layernorm", f"{TOKENS}x{HIDDEN} bf16, fp32 gemma/beta", ours,
                   bytes=2 * TOKENS * HIDDEN * ES + 2 * HIDDEN * 4, flops=7.0 * TOKENS * HIDDEN,
                   baseline=("torch F.layer_norm (bf16 params)", base), backend="cuda")


def _act_rows(fn, act: str, name: str, target_us, args: RoutineArgs):
    dev = torch.device(args.device)
    x = _x((TOKENS, 2 * INTER), dev, 0)
    _check(fn(x), act_and_mul_reference(x, act))
    sets = rotating_inputs(lambda i: (_x((TOKENS, 2 * INTER), dev, i),), dev)
    ours = time_fn(lambda x: fn(x), sets)
    torch_act = F.silu if act == "silu" else F.gelu
    base = time_fn(lambda x: torch_act(x[..., :INTER]) * x[..., INTER:], sets)
    yield BenchRow(name, f"{TOKENS}x2*{INTER} bf16", ours,
                   bytes=3 * TOKENS * INTER * ES, flops=5.0 * TOKENS * INTER,
                   baseline=(f"torch F.{torch_act.__name__}(x[..., :d]) * x[..., d:]", base),
                   target_us=target_us, backend="cuda")


@routine("silu_and_mul", family="fi-sampling", help="silu_and_mul 8192 x 2*14336 bf16 vs torch")
def bench_silu_and_mul(args: RoutineArgs):
    yield from _act_rows(silu_and_mul, "silu", "silu_and_mul", 171.0, args)


@routine("gelu_and_mul", family="fi-sampling", help="gelu_and_mul 8192 x 2*14336 bf16 vs torch")
def bench_gelu_and_mul(args: RoutineArgs):
    yield from _act_rows(gelu_and_mul, "gelu", "gelu_and_mul", None, args)

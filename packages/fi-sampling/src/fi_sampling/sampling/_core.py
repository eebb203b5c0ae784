"""Destination-passing cores of the sampling ops: backend choice, the CUDA launches, the reference
fallbacks, and the torch custom ops (with fake impls) that torch.compile traces through."""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import Backend, OpInfo, arch_of, current_stream, load, on_device, register_op
from fi_core.launch import ptr

from . import reference
from .spec import logits_spec, sampling_spec, threshold_spec

# 0-4: fi_sampling_filtered modes on probabilities; 5-7: fi_sampling_from_logits (softmax fused).
MODES = {"plain": 0, "top_k": 1, "top_p": 2, "min_p": 3, "joint": 4,
         "top_k_first_logits": 5, "plain_logits": 6, "joint_logits": 7}
_KIND = {0: "plain", 1: "top_k", 2: "top_p", 3: "min_p", 4: "top_k_top_p"}
# variant -> (kernel mode of fi_sampling_from_logits, reference kind, filter_apply_order)
_LOGITS = {5: (2, "top_k_top_p", "top_k_first"), 6: (0, "plain", "joint"),
           7: (4, "top_k_top_p", "joint")}
THRESHOLD_MODES = {"top_k_renorm": 0, "top_p_renorm": 1, "top_k_mask": 2}


def _backends(kernel: bool) -> tuple[Backend, ...]:
    ref = Backend("reference", devices=("cpu", "cuda"), notes="pure torch, float64 math")
    if not kernel:
        return (ref,)
    return (Backend("cuda", min_arch="8.0", dtypes=(torch.float32,),
                    notes="sorting-free, one block per row"), ref)


def make_op(name: str, *, module: str = "sampling", kernel: bool = True,
            threshold: bool = False, stability: str = "stable") -> OpInfo:
    specs = None
    if kernel:
        specs = (lambda arch: [threshold_spec(arch)]) if threshold else \
            (lambda arch: [sampling_spec(arch), logits_spec(arch)])
    return register_op(OpInfo(name=name, family="fi-sampling", api=f"flashinfer.{module}.{name}",
                              backends=_backends(kernel), specs=specs, stability=stability))


_CHOICE: dict = {}


def backend_for(op: OpInfo, t: torch.Tensor) -> str:
    key = (op.name, t.device, t.dtype)
    name = _CHOICE.get(key)
    if name is None:
        name = op.choose(device=t.device, dtype=t.dtype).name
        _CHOICE[key] = name
    return name


def _host_int(t: Optional[torch.Tensor], default: int) -> int:
    return default if t is None else int(t.reshape(-1)[0])


# ---- filtered sampling ------------------------------------------------------------------------
def filtered_sampling_impl(out: torch.Tensor, probs: torch.Tensor, indices: Optional[torch.Tensor],
                           variant: int, k_arr: Optional[torch.Tensor], k: int,
                           thr_arr: Optional[torch.Tensor], thr: float,
                           seed_arr: Optional[torch.Tensor], seed: int,
                           off_arr: Optional[torch.Tensor], off: int, backend: str) -> None:
    if backend == "cuda" and variant in _LOGITS:
        mod = load(logits_spec(arch_of(probs.device)))
        ss = 0 if seed_arr is None or seed_arr.numel() == 1 else 1
        os_ = 0 if off_arr is None or off_arr.numel() == 1 else 1
        with on_device(probs.device):
            mod.fi_sampling_from_logits(
                out.data_ptr(), probs.data_ptr(), ptr(indices), out.shape[0], probs.shape[0],
                probs.shape[1], probs.stride(0), _LOGITS[variant][0], ptr(k_arr), int(k), ptr(thr_arr), float(thr),
                ptr(seed_arr), int(seed), ss, ptr(off_arr), int(off), os_, current_stream(probs.device))
        return
    if backend == "cuda":
        mod = load(sampling_spec(arch_of(probs.device)))
        ss = 0 if seed_arr is None or seed_arr.numel() == 1 else 1
        os_ = 0 if off_arr is None or off_arr.numel() == 1 else 1
        with on_device(probs.device):
            mod.fi_sampling_filtered(
                out.data_ptr(), probs.data_ptr(), ptr(indices), out.shape[0], probs.shape[0],
                probs.shape[1], probs.stride(0), variant, ptr(k_arr), int(k), ptr(thr_arr), float(thr),
                ptr(seed_arr), int(seed), ss, ptr(off_arr), int(off), os_, current_stream(probs.device))
        return
    top_k = k_arr if k_arr is not None else k
    t = thr_arr if thr_arr is not None else thr
    if variant in _LOGITS:  # `probs` holds logits here
        _, kind, order = _LOGITS[variant]
        dist = reference.filtered_probs(torch.softmax(probs.double(), dim=-1), kind, top_k=top_k,
                                        top_p=t, filter_apply_order=order)
    else:
        kind = _KIND[variant]
        dist = reference.filtered_probs(probs, kind, top_k=top_k, top_p=t, min_p=t,
                                        filter_apply_order="joint")
    res = reference.sample(dist, indices, _host_int(seed_arr, seed), _host_int(off_arr, off))
    out.copy_(res.to(out.device))


@torch.library.custom_op("fi_sampling::filtered_sampling", mutates_args=("out",))
def _filtered_sampling_op(out: torch.Tensor, probs: torch.Tensor, indices: Optional[torch.Tensor],
                          variant: int, k_arr: Optional[torch.Tensor], k: int,
                          thr_arr: Optional[torch.Tensor], thr: float,
                          seed_arr: Optional[torch.Tensor], seed: int,
                          off_arr: Optional[torch.Tensor], off: int, backend: str) -> None:
    filtered_sampling_impl(out, probs, indices, variant, k_arr, k, thr_arr, thr, seed_arr, seed,
                           off_arr, off, backend)


@_filtered_sampling_op.register_fake
def _(out, probs, indices, variant, k_arr, k, thr_arr, thr, seed_arr, seed, off_arr, off, backend) -> None:
    return None


def filtered_sampling(*args) -> None:
    if torch.compiler.is_compiling():
        torch.ops.fi_sampling.filtered_sampling(*args)
    else:
        filtered_sampling_impl(*args)


# ---- thresholds: renorm / mask ----------------------------------------------------------------
def threshold_impl(out: torch.Tensor, x: torch.Tensor, variant: int, k_arr: Optional[torch.Tensor],
                   k: int, p_arr: Optional[torch.Tensor], p: float, backend: str) -> None:
    if backend == "cuda":
        mod = load(threshold_spec(arch_of(x.device)))
        with on_device(x.device):
            mod.fi_sampling_threshold(out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1],
                                      x.stride(0), out.stride(0), variant, ptr(k_arr), int(k),
                                      ptr(p_arr), float(p), current_stream(x.device))
        return
    top_k = k_arr if k_arr is not None else k
    top_p = p_arr if p_arr is not None else p
    if variant == 0:
        out.copy_(reference.top_k_renorm_probs(x, top_k))
    elif variant == 1:
        out.copy_(reference.top_p_renorm_probs(x, top_p))
    else:
        out.copy_(reference.top_k_mask_logits(x, top_k))


@torch.library.custom_op("fi_sampling::threshold", mutates_args=("out",))
def _threshold_op(out: torch.Tensor, x: torch.Tensor, variant: int, k_arr: Optional[torch.Tensor],
                  k: int, p_arr: Optional[torch.Tensor], p: float, backend: str) -> None:
    threshold_impl(out, x, variant, k_arr, k, p_arr, p, backend)


@_threshold_op.register_fake
def _(out, x, variant, k_arr, k, p_arr, p, backend) -> None:
    return None


def threshold(*args) -> None:
    if torch.compiler.is_compiling():
        torch.ops.fi_sampling.threshold(*args)
    else:
        threshold_impl(*args)


# ---- softmax ----------------------------------------------------------------------------------
def softmax_impl(out: torch.Tensor, x: torch.Tensor, t_arr: Optional[torch.Tensor], t: float,
                 backend: str) -> None:
    if backend == "cuda":
        mod = load(threshold_spec(arch_of(x.device)))
        with on_device(x.device):
            mod.fi_sampling_softmax(out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                    out.stride(0), ptr(t_arr), float(t), current_stream(x.device))
        return
    out.copy_(reference.softmax(x, t_arr if t_arr is not None else t))


@torch.library.custom_op("fi_sampling::softmax", mutates_args=("out",))
def _softmax_op(out: torch.Tensor, x: torch.Tensor, t_arr: Optional[torch.Tensor], t: float,
                backend: str) -> None:
    softmax_impl(out, x, t_arr, t, backend)


@_softmax_op.register_fake
def _(out, x, t_arr, t, backend) -> None:
    return None


def softmax_into(*args) -> None:
    if torch.compiler.is_compiling():
        torch.ops.fi_sampling.softmax(*args)
    else:
        softmax_impl(*args)

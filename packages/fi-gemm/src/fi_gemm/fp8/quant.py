"""FP8 quantisation helpers (per-tensor; per-token-group 1 x 128; 128 x 128 weight blocks).

They return the fp8 tensor and the *dequantisation* scale(s) (x ~= x_fp8 * scale), the form
bmm_fp8 and gemm_fp8_nt_groupwise take. Pure torch (elementwise + reductions, bandwidth-bound);
no host synchronisation, so they capture into CUDA graphs. Each is its own reference: the tests
check them against explicit per-element formulas.
"""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import checks
from fi_core.errors import InputError

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_EPS = 1e-12


def _check(x: torch.Tensor, dtype: torch.dtype) -> None:
    checks.tensor("x", x)
    if not x.is_floating_point() or x.dtype in _FP8:
        raise InputError(f"x must be a 16/32-bit float tensor, got {x.dtype}")
    if dtype not in _FP8:
        raise InputError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")


def quantize_fp8_per_tensor(x: torch.Tensor, scale: Optional[torch.Tensor] = None,
                            dtype: torch.dtype = torch.float8_e4m3fn):
    """Quantise with one scale: ``scale = amax(|x|) / fp8_max`` unless given.

    Returns ``(x_fp8, scale)`` with scale a float32 tensor of shape [1].

    Examples
    --------
    >>> import torch
    >>> from fi_gemm import quantize_fp8_per_tensor
    >>> q, s = quantize_fp8_per_tensor(torch.tensor([1.0, -448.0]))
    >>> float(s), q.float().tolist()
    (1.0, [1.0, -448.0])
    """
    _check(x, dtype)
    fmax = torch.finfo(dtype).max
    if scale is None:
        scale = (x.abs().amax().float().clamp(min=_EPS) / fmax).reshape(1)
    else:
        scale = scale.float().reshape(1)
    q = (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


def quantize_fp8_per_token_group(x: torch.Tensor, group_size: int = 128,
                                 dtype: torch.dtype = torch.float8_e4m3fn,
                                 scale_major_mode: str = "K"):
    """Quantise each row in groups of ``group_size`` columns (DeepSeek 1 x 128 activations).

    x: [m, k]. Returns ``(x_fp8 [m, k], scales)`` with scales [m, ceil(k/g)] for
    ``scale_major_mode="K"`` or [ceil(k/g), m] (contiguous, "MN") for "MN".
    """
    _check(x, dtype)
    checks.ndim("x", x, (2,))
    if scale_major_mode not in ("K", "MN"):
        raise InputError(f"scale_major_mode must be 'K' or 'MN', got {scale_major_mode!r}")
    m, k = x.shape
    kb = -(-k // group_size)
    fmax = torch.finfo(dtype).max
    pad = kb * group_size - k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, kb, group_size)
    scales = xf.abs().amax(dim=2).clamp(min=_EPS) / fmax
    q = (xf / scales[:, :, None]).clamp(-fmax, fmax).view(m, kb * group_size)[:, :k].to(dtype)
    if scale_major_mode == "MN":
        scales = scales.T.contiguous()
    return q, scales


def quantize_fp8_block(w: torch.Tensor, block: int = 128,
                       dtype: torch.dtype = torch.float8_e4m3fn, scale_major_mode: str = "K"):
    """Quantise a weight [n, k] in ``block x block`` tiles (DeepSeek 128 x 128 weights).

    Returns ``(w_fp8 [n, k], scales)`` with scales [ceil(n/b), ceil(k/b)] for "K" or the
    transpose [ceil(k/b), ceil(n/b)] (contiguous) for "MN".
    """
    _check(w, dtype)
    checks.ndim("w", w, (2,))
    if scale_major_mode not in ("K", "MN"):
        raise InputError(f"scale_major_mode must be 'K' or 'MN', got {scale_major_mode!r}")
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    fmax = torch.finfo(dtype).max
    wf = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    tiles = wf.view(nb, block, kb, block)
    scales = tiles.abs().amax(dim=(1, 3)).clamp(min=_EPS) / fmax
    q = (tiles / scales[:, None, :, None]).clamp(-fmax, fmax).view(nb * block, kb * block)
    q = q[:n, :k].to(dtype)
    if scale_major_mode == "MN":
        scales = scales.T.contiguous()
    return q, scales

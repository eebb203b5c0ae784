"""Pure-torch references for the dense GEMMs: fp32 math on the (dequantised) inputs, one rounding
to the output dtype at the end, exactly where the kernels round. Also the CPU backend."""

from __future__ import annotations

from typing import Optional

import torch


def gemm_reference(a: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                   bias: Optional[torch.Tensor] = None, scale_a: Optional[torch.Tensor] = None,
                   scale_b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(a @ w^T) * scale_a * scale_b + bias`` in fp32, cast to ``out_dtype``.

    a: [..., M, K], w: [..., N, K] (any float dtype incl. fp8), bias: [N] or None,
    scale_a / scale_b: one-element float32 tensors or None. Returns [..., M, N].
    """
    acc = torch.matmul(a.float(), w.float().transpose(-1, -2))
    if scale_a is not None:
        acc = acc * scale_a.float().reshape(())
    if scale_b is not None:
        acc = acc * scale_b.float().reshape(())
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)

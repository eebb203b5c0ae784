"""Reference for segment / grouped GEMM: per segment, fp32 math, one rounding at the end."""

from __future__ import annotations

from typing import Optional

import torch


def segment_gemm_reference(x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor,
                           weight_indices: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """out[r0:r1] = x[r0:r1] @ w[weight_indices[s]]^T for each segment s = [r0, r1).

    x: [total, K], w: [num_weights, N, K], seg_indptr: [S + 1], weight_indices: [S] or None
    (segment s uses w[s]). Rows outside every segment of `out` are left as they are.
    Synchronises (reads the indptr on the host): the reference is not graph-safe.
    """
    ip = seg_indptr.tolist()
    wi = weight_indices.tolist() if weight_indices is not None else list(range(len(ip) - 1))
    for s in range(len(ip) - 1):
        r0, r1 = ip[s], ip[s + 1]
        if r1 > r0:
            out[r0:r1] = (x[r0:r1].float() @ w[wi[s]].float().T).to(out.dtype)
    return out

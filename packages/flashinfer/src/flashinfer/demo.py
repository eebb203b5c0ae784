"""`flashinfer demo`: a batched decode loop of a small random-weight Llama-style model.

Every step runs what a serving engine runs per token: RMSNorm, QKV projection, RoPE, append to a
paged KV cache, batch decode attention over the paged cache, output projection, fused
add+RMSNorm, gated MLP (SiLU-and-mul), LM head, softmax with temperature and top-p sampling. Each
op goes through this library when the family providing it is installed and implements it, and
through plain torch otherwise; the report says which ran where and prints tokens/s. Weights are
stored [out, in] (the nn.Linear layout) and every projection is ``mm_bf16(x, W.T)``. Without a
GPU the library runs its CPU reference backend (slow, correct), and the demo says so.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Optional
from collections.abc import Callable

import torch


@dataclass
class Config:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    batch: int
    prompt: int
    steps: int
    page_size: int = 16


GPU_CONFIG = Config(layers=4, hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=5632,
                    vocab=32000, batch=16, prompt=64, steps=64)
CPU_CONFIG = Config(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                    vocab=1024, batch=4, prompt=8, steps=8)


@dataclass
class Ops:
    """Resolves each op to the library or to torch, and remembers which one ran."""

    device: torch.device
    used: dict = field(default_factory=dict)

    def get(self, module: str, name: str, fallback: Callable, op_name: Optional[str] = None,
            dtype: torch.dtype = torch.bfloat16):
        import importlib  # noqa: PLC0415

        try:
            fn = getattr(importlib.import_module(f"flashinfer.{module}"), name)
            where = "fi"
        except (ImportError, AttributeError):
            fn, where = fallback, "torch (not provided by fi yet)"
        if where == "fi":
            where = self._backend(op_name or name, dtype)
        self.used[f"{module}.{name}"] = where
        return fn

    def _backend(self, op_name: str, dtype: torch.dtype) -> str:
        from fi_core.registry import OPS  # noqa: PLC0415

        op = OPS.get(op_name)
        if op is None:
            return "fi"
        try:
            return f"fi:{op.choose(self.device, dtype).name}"
        except Exception as exc:  # report, the call itself will raise if it cannot run
            return f"fi (backend choice failed: {exc})"


# ----- torch fallbacks -------------------------------------------------------------------------

def _rmsnorm(x, w, eps=1e-6, out=None, enable_pdl=None):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _fused_add_rmsnorm(x, residual, w, eps=1e-6, enable_pdl=None):
    residual.add_(x)
    x.copy_(_rmsnorm(residual, w, eps))


def _silu_and_mul(x, out=None, enable_pdl=None):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def _rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    d = q.shape[-1]
    inv = 1.0 / (rope_theta ** (torch.arange(0, d, 2, device=q.device, dtype=torch.float32) / d))
    ang = pos_ids.float()[:, None] * inv[None, :] / rope_scale
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rot(x):
        x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
    return rot(q), rot(k)


def _sample_top_p(probs, top_p, **kw):
    sorted_p, idx = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    sorted_p = sorted_p * keep
    choice = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1)
    return idx.gather(-1, choice).squeeze(-1).to(torch.int32)


def _mm(a, b, bias=None, pdl=False, out=None, out_dtype=None, backend="auto"):
    return a @ b


def _softmax(logits, temperature=None, enable_pdl=None):
    t = 1.0 if temperature is None else temperature
    return torch.softmax(logits.float() / t, -1)


class PagedCache:
    """Pages handed out as sequences grow; a torch-only fallback for attention and append."""

    def __init__(self, cfg: Config, device, dtype, max_len: int):
        self.cfg = cfg
        pages_per_seq = math.ceil(max_len / cfg.page_size)
        self.kv = [torch.zeros(cfg.batch * pages_per_seq, 2, cfg.page_size, cfg.kv_heads, cfg.head_dim,
                               device=device, dtype=dtype) for _ in range(cfg.layers)]
        # Sequence b owns pages b*pages_per_seq ... in order (a real engine would use a free list).
        self.pages_per_seq = pages_per_seq
        self.lens = [0] * cfg.batch
        self.device = device

    def metadata(self):
        ps = self.cfg.page_size
        npages = [max(1, math.ceil(n / ps)) for n in self.lens]
        indptr = [0]
        for n in npages:
            indptr.append(indptr[-1] + n)
        indices = [b * self.pages_per_seq + j for b, n in enumerate(npages) for j in range(n)]
        last = [n - (math.ceil(n / ps) - 1) * ps if n else 0 for n in self.lens]
        as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=self.device)  # noqa: E731
        return as_t(indptr), as_t(indices), as_t(last)


def run_demo(cfg: Config, device: torch.device, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    dtype = torch.bfloat16
    ops = Ops(device)
    rmsnorm = ops.get("norm", "rmsnorm", _rmsnorm)
    fused_add_rmsnorm = ops.get("norm", "fused_add_rmsnorm", _fused_add_rmsnorm)
    silu_and_mul = ops.get("activation", "silu_and_mul", _silu_and_mul)
    rope = ops.get("rope", "apply_rope_pos_ids", _rope_pos_ids)
    # logits and probabilities are float32: report the backend chosen for that dtype
    softmax = ops.get("sampling", "softmax", _softmax, dtype=torch.float32)
    sample = ops.get("sampling", "top_p_sampling_from_probs", _sample_top_p, dtype=torch.float32)
    append = ops.get("page", "append_paged_kv_cache", None)
    Wrapper = ops.get("decode", "BatchDecodeWithPagedKVCacheWrapper", None,
                      op_name="batch_decode_with_paged_kv_cache")
    use_fi_attention = append is not None and Wrapper is not None
    if not use_fi_attention:
        ops.used["page.append_paged_kv_cache"] = ops.used["decode.BatchDecodeWithPagedKVCacheWrapper"] = \
            "torch (not provided by fi yet)"
    mm = ops.get("gemm", "mm_bf16", _mm)

    H, D, Hk = cfg.heads, cfg.head_dim, cfg.kv_heads
    s = 0.02
    layers = []

    def gain():
        return (1.0 + s * torch.randn(cfg.hidden, device=device)).to(dtype)
    for _ in range(cfg.layers):
        layers.append(dict(
            ln1=gain(),
            ln2=gain(),
            wqkv=(torch.randn((H + 2 * Hk) * D, cfg.hidden, device=device) * s).to(dtype),
            wo=(torch.randn(cfg.hidden, H * D, device=device) * s).to(dtype),
            wgu=(torch.randn(2 * cfg.intermediate, cfg.hidden, device=device) * s).to(dtype),
            wd=(torch.randn(cfg.hidden, cfg.intermediate, device=device) * s).to(dtype),
        ))
    embed = (torch.randn(cfg.vocab, cfg.hidden, device=device) * 0.5).to(dtype)
    lm_head = (torch.randn(cfg.vocab, cfg.hidden, device=device) * s).to(dtype)
    final_ln = torch.ones(cfg.hidden, device=device, dtype=dtype)

    total = cfg.prompt + cfg.steps
    cache = PagedCache(cfg, device, dtype, total)
    workspace = torch.empty(128 << 20 if device.type == "cuda" else 1 << 20, dtype=torch.uint8, device=device)
    wrapper = Wrapper(workspace, "NHD") if use_fi_attention else None
    tokens = torch.randint(0, cfg.vocab, (cfg.batch,), device=device)
    generated = []
    t_decode = None

    for step in range(total):
        if step == cfg.prompt:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_decode = time.perf_counter()
        positions = torch.full((cfg.batch,), step, dtype=torch.int32, device=device)
        cache.lens = [step + 1] * cfg.batch
        indptr, indices, last = cache.metadata()
        if wrapper is not None:
            wrapper.plan(indptr, indices, last, H, Hk, D, cfg.page_size, q_data_type=dtype, kv_data_type=dtype)
        x = embed[tokens]
        residual = x.clone()
        x = rmsnorm(x, layers[0]["ln1"], 1e-6)
        for li, L in enumerate(layers):
            if li > 0:
                fused_add_rmsnorm(x, residual, L["ln1"], 1e-6)
            qkv = mm(x, L["wqkv"].T)
            q = qkv[:, : H * D].reshape(cfg.batch, H, D)
            k = qkv[:, H * D: (H + Hk) * D].reshape(cfg.batch, Hk, D)
            v = qkv[:, (H + Hk) * D:].reshape(cfg.batch, Hk, D)
            q, k = rope(q.contiguous(), k.contiguous(), positions)
            if use_fi_attention:
                batch_idx = torch.arange(cfg.batch, dtype=torch.int32, device=device)
                append(k, v.contiguous(), batch_idx, positions, cache.kv[li], indices, indptr, last, "NHD")
                o = wrapper.run(q, cache.kv[li])
            else:
                o = _torch_decode_attention(q, k, v, cache, li, step)
            attn = mm(o.reshape(cfg.batch, H * D), L["wo"].T)
            fused_add_rmsnorm(attn, residual, L["ln2"], 1e-6)
            h = silu_and_mul(mm(attn, L["wgu"].T))
            x = mm(h, L["wd"].T)
        fused_add_rmsnorm(x, residual, final_ln, 1e-6)
        logits = mm(x, lm_head.T).float()
        if step + 1 >= cfg.prompt:
            probs = softmax(logits, 0.8)
            tokens = sample(probs, 0.9).long()
            generated.append(tokens)
        else:
            tokens = torch.randint(0, cfg.vocab, (cfg.batch,), device=device)  # the prompt
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t_decode
    out = torch.stack(generated[:-1], 1) if len(generated) > 1 else torch.empty(0)
    if ((out < 0) | (out >= cfg.vocab)).any():
        raise RuntimeError("sampled token ids out of range")
    return {"tokens_per_s": cfg.batch * cfg.steps / elapsed, "elapsed_s": elapsed,
            "tokens": out, "ops": ops.used, "dtype": str(dtype).replace("torch.", "")}


def _torch_decode_attention(q, k, v, cache: PagedCache, layer: int, step: int):
    ps = cache.cfg.page_size
    kv = cache.kv[layer]
    b = torch.arange(q.shape[0], device=q.device)
    page = b * cache.pages_per_seq + step // ps
    kv[page, 0, step % ps] = k
    kv[page, 1, step % ps] = v
    n = step + 1
    out = []
    for i in range(q.shape[0]):
        pages = kv[i * cache.pages_per_seq: i * cache.pages_per_seq + math.ceil(n / ps)]
        kk = pages[:, 0].reshape(-1, *pages.shape[-2:])[:n]
        vv = pages[:, 1].reshape(-1, *pages.shape[-2:])[:n]
        g = q.shape[1] // kk.shape[1]
        kk = kk.repeat_interleave(g, 1).transpose(0, 1).float()
        vv = vv.repeat_interleave(g, 1).transpose(0, 1).float()
        s = torch.einsum("hd,hnd->hn", q[i].float(), kk) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("hn,hnd->hd", s.softmax(-1), vv).to(q.dtype))
    return torch.stack(out)


def cmd_demo(args) -> int:
    use_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if use_gpu else "cpu")
    cfg = GPU_CONFIG if use_gpu else CPU_CONFIG
    if args.steps:
        cfg.steps = args.steps
    if not use_gpu:
        print("notice: no CUDA GPU in use: fi runs its CPU reference backend (pure torch, slow, "
              "correct); on a GPU the same calls run the CUDA kernels.")
    print(f"model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads}/{cfg.kv_heads} heads x "
          f"{cfg.head_dim}, vocab {cfg.vocab}; batch {cfg.batch}, prompt {cfg.prompt}, "
          f"{cfg.steps} decode steps, page size {cfg.page_size}, on {device}")
    res = run_demo(cfg, device, seed=args.seed)
    print(f"decode: {res['tokens_per_s']:.1f} tokens/s ({cfg.batch} sequences x {cfg.steps} steps "
          f"in {res['elapsed_s']:.2f} s, {res['dtype']})")
    print("ops:")
    for name, where in res["ops"].items():
        print(f"  {name:<48} {where}")
    print(f"first sequence's tokens: {res['tokens'][0][:16].tolist()}")
    return 0


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="batched decode loop of a random Llama-style model")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    p.add_argument("--steps", type=int, default=0, help="decode steps (default per device)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_demo)

"""fi-core's own benchmark routine: host cost of a launch through the C-ABI path.

`flashinfer bench --routine launch_overhead` measures, per call: the empty self-test kernel
launched through ctypes with the current-stream lookup, a torch op on a 1-element tensor, and the
raw ctypes call alone; and it checks that a launch captured in a CUDA graph replays correctly.
"""

from __future__ import annotations

import torch

from .arch import arch_of
from .bench import BenchRow, RoutineArgs, Timing, routine, time_host_stats
from .jit import load
from .launch import current_stream
from .selftest import axpb_reference, selftest_spec


def _graph_replay_check(mod, dev) -> str:
    x = torch.randn(4097, device=dev)
    y = torch.full_like(x, float("nan"))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            mod.fi_selftest_axpb(y.data_ptr(), x.data_ptr(), 2.0, 1.0, x.numel(), current_stream(dev))
    torch.cuda.synchronize()
    x.copy_(torch.randn(4097, device=dev))  # new data, same buffer: the replay must see it
    g.replay()
    torch.cuda.synchronize()
    err = (y - axpb_reference(x, 2.0, 1.0)).abs().max().item()
    if not err <= 1e-6:
        raise AssertionError(f"graph replay of a C-ABI launch is wrong: max error {err}")
    return f"ok (max err {err:.1e})"


@routine("launch_overhead", family="fi-core", help="host time per launch: C-ABI path vs torch op")
def launch_overhead(args: RoutineArgs):
    dev = torch.device("cuda", torch.cuda.current_device())
    mod = load(selftest_spec(arch_of(dev)))
    noop = mod.fi_selftest_noop
    raw = noop.raw
    s0 = current_stream(dev)
    t = torch.ones(1, device=dev)
    graph = _graph_replay_check(mod, dev)

    def row(name, fn, note=""):
        # median / min / max of 7 batch means: the host's speed drifts (fi_core.bench.time_host_stats)
        med, low, high = time_host_stats(fn, batches=7)
        return BenchRow("launch_overhead", name, Timing(med, low, high, 7, "host"),
                        extra={"note": note, "graph_replay": graph})

    yield row("fi C-ABI launch incl. stream lookup", lambda: noop(current_stream(dev)), "target <= 5 us")
    yield row("fi C-ABI launch, stream cached", lambda: noop(s0))
    yield row("raw ctypes call, no error check", lambda: raw(s0))
    yield row("torch op on 1-element tensor (t.add_(1))", lambda: t.add_(1))
    yield row("current_stream lookup alone", lambda: current_stream(dev))

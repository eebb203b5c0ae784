"""The CUDA host path of BatchDecodeWithPagedKVCacheWrapper, on a machine without a GPU.

Inside ``with HostSim() as sim``, ``sim.wrapper(...)`` builds a wrapper that believes its workspace
is on ``cuda:0``: plan() and run() execute the same Python as on a GPU, up to and including the
launcher call. Only what needs a GPU is replaced:

- device buffers are CPU tensors (``device_memory="cpu"``: contents can be checked) or meta
  tensors (``"meta"``: a copy costs its dispatch but moves nothing, like an asynchronous copy);
  pinned buffers are pageable; events and streams are stand-ins that count their calls;
- the kernel module is a stand-in: its launcher either records each call's argument block and
  stream (``launcher="record"``, for tests) or is a native no-op (``"noop"``, for timing: built
  with the system C compiler, else the recording one); its split-KV planners are the real
  ones (decode_planner.h's fi_plan_decode and fi_plan_decode_staged built with the system C++
  compiler; without one, the Python planner);
- the wrapper's tensors (q, cache, out) are CPU tensors; its device index is -1, CPU's;
- the stream and capture queries are Python functions that count their calls, or, with the no-op
  launcher, C builtins (``abs``, ``bool``) that cost about what torch's C functions do.

What it cannot show: the cost of the CUDA calls themselves (kernel launch, cudaMemcpyAsync, event
record), which the H200 numbers include. Used by ``tools/host_overhead.py`` and the CPU tests of
the host path.

Examples
--------
>>> with HostSim() as sim:                                                   # doctest: +SKIP
...     w = sim.wrapper()
...     w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
...     w.run(q, cache, out=out)
...     args, stream = sim.launches[-1]
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import types
from typing import Optional

import torch

from fi_core import Arch
from fi_core.errors import CudaError

from . import launch as _launch

DecodeArgs = _launch.DecodeArgs
# The launcher ABI of the tree this module runs in (tools/host_overhead.py --baseline loads it into
# older trees): fi_batch_decode(args) with the stream in the block, or (args, stream) before.
_ONE_ARG = any(name == "stream" for name, _ in DecodeArgs._fields_)
REFUSE_CAPTURE = getattr(_launch, "REFUSE_CAPTURE", 0)
CAPTURE_REFUSED = getattr(_launch, "CAPTURE_REFUSED", 900)

try:
    from .spec import PLAN_DECODE_ARGS
except ImportError:  # tools/host_overhead.py --baseline: a tree from before the native planner
    PLAN_DECODE_ARGS = None
try:
    from .spec import PLAN_DECODE_STAGED_ARGS
except ImportError:  # a tree from before the staged planner
    PLAN_DECODE_STAGED_ARGS = None

FAKE_STREAM = 0x5E5
SM_COUNT, CTAS_PER_SM = 132, 2  # an H200 with the tensor-core decode kernel (the ring: 2 per SM)

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * (1 if _ONE_ARG else 2))
_NOOP_C = ("int fi_batch_decode(const void* a) { (void)a; return 0; }\n" if _ONE_ARG else
           "int fi_batch_decode(const void* a, void* s) { (void)a; (void)s; return 0; }\n")


def _host_library(compilers: tuple, flags: list, source: str, name: str) -> Optional[ctypes.CDLL]:
    """``source`` (a file path) built with the first of ``compilers`` on PATH into a shared library
    ``name``.so and loaded; None without a compiler or when the build fails."""
    cc = next((c for c in map(shutil.which, compilers) if c), None)
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="fi-hostsim-") as d:  # the loaded library outlives its file
        lib = os.path.join(d, name + ".so")
        if subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", lib, source], capture_output=True).returncode:
            return None
        return ctypes.CDLL(lib)


def native_noop() -> Optional[ctypes._CFuncPtr]:
    """``int fi_batch_decode(const void*)`` (older trees: ``(const void*, void*)``) returning 0,
    compiled with ``cc``; None without a compiler."""
    with tempfile.TemporaryDirectory(prefix="fi-hostsim-") as d:
        src = os.path.join(d, "noop.c")
        with open(src, "w") as f:
            f.write(_NOOP_C)
        lib = _host_library(("cc", "gcc"), ["-O2"], src, "noop")
    if lib is None:
        return None
    fn = lib.fi_batch_decode
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p] * (1 if _ONE_ARG else 2)
    return fn


# The header of the decode package this module's relative imports bind to: tools/host_overhead.py
# loads this file into older trees, whose planner entry points must match their spec's arguments.
_PLANNER_H = os.path.join(os.path.dirname(os.path.abspath(importlib.import_module(".launch", __package__).__file__)),
                          "decode_planner.h")


def native_planner() -> Optional[ctypes._CFuncPtr]:
    """``fi_plan_decode`` of decode_planner.h, built with the system C++ compiler (what every
    decode module exports, without CUDA); None without a compiler."""
    return native_planners().get("fi_plan_decode")


@functools.cache  # one build per process
def native_planners() -> dict:
    """{entry name: ctypes function} of decode_planner.h's exports (fi_plan_decode and, in trees
    that have it, fi_plan_decode_staged), built with the system C++ compiler; {} without one."""
    if PLAN_DECODE_ARGS is None:  # a tree from before the native planner
        return {}
    lib = _host_library(("c++", "g++"), ["-O3", "-x", "c++"], _PLANNER_H, "planner")
    if lib is None:
        return {}
    from fi_core.jit import bind_entry  # noqa: PLC0415  (the trees that have the planner have it)
    out = {"fi_plan_decode": bind_entry(lib.fi_plan_decode, PLAN_DECODE_ARGS)}
    if PLAN_DECODE_STAGED_ARGS is not None:
        out["fi_plan_decode_staged"] = bind_entry(lib.fi_plan_decode_staged, PLAN_DECODE_STAGED_ARGS)
    return out


class _Entry:
    def __init__(self, raw):
        self.raw = raw


class FakeModule:
    """Stands in for a loaded decode module (see fi_core.jit.Module)."""

    def __init__(self, launch, planners: dict, copy_tables):
        self._launch = launch
        self._planners = planners
        self._copy_tables = copy_tables

    def fn(self, name: str) -> _Entry:
        if name.startswith("fi_plan_decode"):
            return _Entry(self._planners.get(name))  # None: no compiler (the Python planner)
        if name == "fi_copy_tables":
            return _Entry(self._copy_tables)
        return _Entry(self._launch)

    def fi_batch_decode_occupancy(self, addr: int) -> None:
        ctypes.c_int.from_address(addr).value = CTAS_PER_SM

    def error(self, code: int, where: str = "") -> CudaError:
        return CudaError(code, "cudaErrorSimulated", "simulated launch failure", where)


class _Event:
    def __init__(self, counts: dict):
        self._counts = counts

    def record(self, stream=None) -> None:
        self._counts["event_record"] += 1

    def synchronize(self) -> None:
        self._counts["event_sync"] += 1


class HostSim:
    """Context manager: patches the decode modules while active (see the module docstring)."""

    def __init__(self, device_memory: str = "cpu", launcher: str = "record"):
        if device_memory not in ("cpu", "meta"):
            raise ValueError(f"device_memory must be 'cpu' or 'meta', got {device_memory!r}")
        self.device_memory = device_memory
        self.launches: list = []  # (DecodeArgs copy, stream) per launch, launcher="record" only
        self.counts = {"event_record": 0, "event_sync": 0, "stream_lookup": 0, "table_copies": 0}
        # What the stream-capture query answers; the recording launcher then refuses a launch that
        # has DecodeArgs.flags REFUSE_CAPTURE, as the real one does.
        self.capturing = False
        self.return_code = 0  # what the recording launcher returns
        self._record_fn = _LAUNCH(self._record)
        launch = native_noop() if launcher == "noop" else None
        self.launcher = "noop" if launch is not None else "record"
        self.module = FakeModule(launch if launch is not None else self._record_fn, native_planners(),
                                 self._copy_tables)
        self._saved: list = []

    # ---- stand-ins ----------------------------------------------------------------------
    def _record(self, args_addr, stream=None) -> int:
        args = DecodeArgs.from_buffer_copy(ctypes.string_at(args_addr, ctypes.sizeof(DecodeArgs)))
        if self.capturing and args.flags & REFUSE_CAPTURE:
            return CAPTURE_REFUSED
        self.launches.append((args, args.stream if stream is None else stream))
        return self.return_code

    def _copy_tables(self, d0, s0, n0, d1, s1, n1, d2, s2, n2, stream) -> int:
        """fi_copy_tables: the three copies between "device" buffers, which are CPU memory here (meta
        buffers have none: nothing to copy)."""
        self.counts["table_copies"] += 1
        if self.device_memory == "cpu":
            for d, src, n in ((d0, s0, n0), (d1, s1, n1), (d2, s2, n2)):
                if n > 0:
                    ctypes.memmove(d, src, n)
        return 0

    def _raw_stream(self, index=None) -> int:
        self.counts["stream_lookup"] += 1
        return FAKE_STREAM

    def _capturing(self) -> bool:
        return self.capturing

    def _torch(self) -> types.ModuleType:
        """torch with device allocations on CPU/meta, no pinning, and stand-in events/streams."""
        shim = types.ModuleType("torch")
        shim.__dict__.update(torch.__dict__)
        memory = self.device_memory

        def empty(*size, device=None, pin_memory=False, **kw):
            if device is not None and torch.device(device).type == "cuda":
                device = memory
            return torch.empty(*size, device=device, **kw)

        def zeros(*size, device=None, **kw):
            if device is not None and torch.device(device).type == "cuda":
                device = memory
            return torch.zeros(*size, device=device, **kw)

        shim.empty = empty
        shim.zeros = zeros
        shim.cuda = types.SimpleNamespace(
            Event=lambda *a, **k: _Event(self.counts), current_stream=lambda *a, **k: object(),
            current_device=lambda: 0, is_current_stream_capturing=self._capturing)
        return shim

    # ---- patching -----------------------------------------------------------------------
    def __enter__(self) -> HostSim:
        pkg = __name__.rsplit(".", 1)[0]
        batch = importlib.import_module(pkg + ".batch")
        mods = [batch]
        if importlib.util.find_spec(pkg + ".staging") is not None:
            mods.append(importlib.import_module(pkg + ".staging"))
        arch_mod = sys.modules["fi_core.arch"]
        shim = self._torch()
        sm90 = Arch.parse("9.0a")
        patches = [(arch_mod, "arch_of", lambda dev=None: sm90)]
        timing = self.launcher == "noop"
        raw_stream = abs if timing else self._raw_stream  # abs(-1): a non-null handle
        capturing = bool if timing else self._capturing  # bool() is False
        for m in mods:
            patches += [(m, "torch", shim), (m, "raw_stream", raw_stream), (m, "_raw_stream", raw_stream),
                        (m, "capturing", capturing), (m, "_capturing", capturing)]
        patches += [(batch, "arch_of", lambda dev=None: sm90), (batch, "load", lambda spec: self.module),
                    (batch, "load_many", lambda specs: [self.module] * len(specs)),
                    (batch, "device_info", lambda index=None: types.SimpleNamespace(sm_count=SM_COUNT))]
        cls = batch.BatchDecodeWithPagedKVCacheWrapper
        real_run_core = cls._run_core

        def run_core(w, q, *args):  # the kernel path for the CPU tensors that stand for device ones
            if w._impl == "cuda" and q.device.type == "cpu":
                return w._launch(q, *args[1:])
            return real_run_core(w, q, *args)

        patches.append((cls, "_run_core", run_core))
        for obj, name, value in patches:
            if hasattr(obj, name):
                self._saved.append((obj, name, getattr(obj, name)))
                setattr(obj, name, value)
        # decisions cached by earlier (real) plans must not leak into the simulation, nor back
        self._caches = [c for c in (getattr(batch, "_IMPL_CACHE", None), getattr(batch, "_MODULE_CACHE", None),
                                    getattr(batch, "_OCCUPANCY", None)) if c is not None]
        self._cache_copies = [dict(c) for c in self._caches]
        for c in self._caches:
            c.clear()
        self._batch = batch
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, value in reversed(self._saved):
            setattr(obj, name, value)
        self._saved.clear()
        for c, saved in zip(self._caches, self._cache_copies):
            c.clear()
            c.update(saved)

    def wrapper(self, workspace_bytes: int = 32 << 20, graph_buffers: Optional[tuple] = None, **kw):
        """A BatchDecodeWithPagedKVCacheWrapper (CUDAGraph... with ``graph_buffers`` =
        (indptr, indices, last_page_len) CPU tensors) on the simulated ``cuda:0``."""
        ws = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device_memory)
        if graph_buffers is not None:
            w = self._batch.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, *graph_buffers, **kw)
        else:
            w = self._batch.BatchDecodeWithPagedKVCacheWrapper(ws, **kw)
        w._device = torch.device("cuda", 0)
        w._dev_index = -1
        if graph_buffers is not None:  # the simulated device's buffers are CPU memory
            w._graph_plain = all(b.dim() == 1 and b.is_contiguous() for b in graph_buffers)
        return w

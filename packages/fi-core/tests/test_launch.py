"""CPU tests of fi_core.launch: the call memo (the fast paths of fi_gemm's ops keep their recorded
call signatures in it) and the device guard every launch sits in."""

import ast
from pathlib import Path

import pytest
import torch

from fi_core import launch
from fi_core.launch import CallMemo


def test_call_memo_is_a_dict_that_forgets_everything_at_its_limit():
    memo = CallMemo(limit=3)
    assert not memo and memo.get(("a",)) is None
    for i in range(3):
        memo.put((i,), f"v{i}")
    assert len(memo) == 3 and memo.get((1,)) == "v1"
    memo.put((1,), "again")  # a held signature is replaced in place, even when full
    assert dict(memo) == {(0,): "v0", (1,): "again", (2,): "v2"}
    memo.put((9,), "v9")  # a new one when full: the memo starts over
    assert dict(memo) == {(9,): "v9"}
    memo.clear()
    assert len(memo) == 0 and memo.limit == 3


def test_call_memo_default_limit():
    assert CallMemo().limit == 1024


# ---- device guard ---------------------------------------------------------------------------
def test_on_device_is_a_no_op_for_the_current_device_and_a_guard_for_another(monkeypatch):
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    made = []
    monkeypatch.setattr(torch.cuda, "device", lambda idx: made.append(idx) or f"guard {idx}")
    same = launch.on_device(torch.device("cuda", 0))
    assert same is launch.on_device(0) is launch.on_device(torch.device("cuda"))  # index None: current
    assert same is launch.on_device(torch.device("cpu")) is launch.on_device(-1)  # nothing to switch
    with same as entered:  # the shared no-op context can be entered again and again
        assert entered is None
    assert made == []
    assert launch.on_device(torch.device("cuda", 1)) == "guard 1"
    assert launch.on_device(3) == "guard 3"
    assert made == [1, 3]
    monkeypatch.setattr(launch, "current_device", lambda: -1)  # a torch without CUDA
    assert launch.on_device(torch.device("cuda", 1)) is same and made == [1, 3]


# Files whose stream lookups launch nothing (timing harnesses, event bookkeeping, the host-path
# simulator) or define the helpers.
_NOT_LAUNCHERS = {"fi_core/launch.py", "fi_core/bench.py", "fi_core/bench_routines.py",
                  "fi_attention/decode/hostsim.py", "fi_attention/decode/staging.py"}
# Called names: "f" for f(...), ".f" for x.f(...). torch.cuda.current_device() is no guard; the
# fast paths compare with fi_core.launch.current_device, imported by name.
_STREAM = {"current_stream", "raw_stream", ".current_stream", ".raw_stream"}
# Launchers whose kernel module switches devices itself: the batch decode launcher reads
# DecodeArgs.device (decode_common.cuh, launch_batch_decode), cheaper than asking torch on the
# run() path.
_GUARDED_IN_C = {"fi_attention/decode/batch.py:run", "fi_attention/decode/batch.py:_launch",
                 "fi_attention/decode/single.py:_single_decode_core"}
_GUARD = {"on_device", ".on_device", "current_device", "_current_device"}


def _called_names(node) -> set:
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            names.add(f.id if isinstance(f, ast.Name) else "." + f.attr if isinstance(f, ast.Attribute) else None)
    return names


def _launchers(src: str) -> dict:
    """{function name: guarded?} for the functions of ``src`` that look up a launch stream;
    guarded: they enter ``on_device`` or compare with ``current_device()`` (a fast path that
    leaves other devices to its checked path)."""
    found = {}
    for fn in ast.walk(ast.parse(src)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = _called_names(fn)
            if names & _STREAM:
                found[fn.name] = bool(names & _GUARD)
    return found


def _unguarded_launchers(src: str) -> list:
    return [name for name, guarded in _launchers(src).items() if not guarded]


def test_the_lint_below_flags_a_launcher_without_a_guard():
    assert _unguarded_launchers("def f(m, x):\n    m.fi_k(x.data_ptr(), current_stream(x.device))\n") == ["f"]
    assert _unguarded_launchers("def f(m, x):\n    with on_device(x.device):\n"
                                "        m.fi_k(x.data_ptr(), current_stream(x.device))\n") == []
    assert _unguarded_launchers("def f(m, x):\n    i = torch.cuda.current_device()\n"
                                "    m.fi_k(x.data_ptr(), raw_stream(i))\n") == ["f"]


def test_every_launch_site_guards_the_device():
    """A new launcher that forgets ``with on_device(...)`` would run on the wrong GPU when its
    tensors are on a device that is not the current one (packages/flashinfer/tests/test_other_gpu.py
    checks the guarded ones on two GPUs)."""
    root = Path(__file__).resolve().parents[2]  # packages/
    files = sorted(root.glob("*/src/**/*.py"))
    if not files:
        pytest.skip("not run from a source checkout")
    bad, seen, in_c = [], 0, set()
    for p in files:
        rel = "/".join(p.relative_to(root).parts[2:])  # below <package>/src/
        found = {} if rel in _NOT_LAUNCHERS else _launchers(p.read_text())
        seen += bool(found)
        for name, guarded in found.items():
            if f"{rel}:{name}" in _GUARDED_IN_C:
                in_c.add(f"{rel}:{name}")
            elif not guarded:
                bad.append(f"{rel}:{name}")
    assert seen >= 10, f"found only {seen} launcher files under {root}"
    assert bad == []
    assert in_c == _GUARDED_IN_C  # no stale entry: each still exists and looks up a stream

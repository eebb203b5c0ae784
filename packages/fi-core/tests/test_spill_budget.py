"""KernelSpec.spill_budget: fi_core.jit.build.spill_problems (the compile check's spill rule) fails
a module's spills unless they are within the budget its spec declares."""

from types import SimpleNamespace

from fi_core.jit.build import spill_problems


def test_spills_fail_unless_within_the_specs_budget():
    kernels = {"kern": {"spill_stores": 64, "spill_loads": 56}, "other": {"spill_stores": 0, "spill_loads": 0}}
    bad, _ = spill_problems(SimpleNamespace(name="m", arch="sm_90a"), kernels)
    assert len(bad) == 1 and "64 B spill stores" in bad[0]
    ok, note = spill_problems(SimpleNamespace(name="m", arch="sm_90a", spill_budget=64), kernels)
    assert ok == [] and "64 B" in note
    over, _ = spill_problems(SimpleNamespace(name="m", arch="sm_90a", spill_budget=32), kernels)
    assert len(over) == 1 and "budget 32 B" in over[0]

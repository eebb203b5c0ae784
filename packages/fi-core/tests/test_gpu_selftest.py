"""On a GPU: the self-test kernel end to end, CUDA errors as exceptions, CUDA-graph capture."""

import pytest
import torch

from fi_core import testing
from fi_core.arch import arch_of, device_info
from fi_core.errors import CudaError
from fi_core.jit import load
from fi_core.launch import current_stream
from fi_core.selftest import axpb, axpb_reference, run_check, selftest_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not testing.has_cuda(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("n", [1, 7, 4097, 1 << 22])
def test_axpb_matches_reference(n):
    x = testing.randn((n,), torch.float32, "cuda", seed=n)
    testing.assert_close(axpb(x, 0.75, 3.0), axpb_reference(x, 0.75, 3.0))


def test_run_check_and_device_facts():
    assert "OK" in run_check()
    info = device_info(torch.cuda.current_device())
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert info.sm_count == props.multi_processor_count
    assert (info.arch.major, info.arch.minor) == (props.major, props.minor)
    assert info.l2_bytes > 0 and info.smem_per_block_optin >= 48 * 1024


def test_cuda_error_carries_runtime_name_and_message():
    mod = load(selftest_spec(arch_of(torch.device("cuda"))))
    err = mod.error(1, "fi_selftest_axpb")
    assert isinstance(err, CudaError) and err.name == "cudaErrorInvalidValue"
    assert "invalid argument" in str(err) and "fi_selftest_axpb" in str(err)


def test_graph_capture_replays_with_new_data():
    x = torch.randn(4097, device="cuda")
    y = torch.full_like(x, float("nan"))
    mod = load(selftest_spec(arch_of(x.device)))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        mod.fi_selftest_axpb(y.data_ptr(), x.data_ptr(), 2.0, 1.0, x.numel(), current_stream(x.device))
    for seed in range(3):
        x.copy_(testing.randn((4097,), torch.float32, "cuda", seed=seed))
        g.replay()
        torch.cuda.synchronize()
        testing.assert_close(y, axpb_reference(x, 2.0, 1.0))


def test_launch_goes_to_current_stream():
    x = torch.randn(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = axpb(x, 1.0, 1.0)
    s.synchronize()
    testing.assert_close(y, axpb_reference(x, 1.0, 1.0))

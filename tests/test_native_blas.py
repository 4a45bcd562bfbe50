"""blas.py: which of cuBLAS's front ends a product that goes to torch's linear runs through."""

import pytest
import torch


@pytest.fixture
def chosen(monkeypatch):
    from worker.engines.native import blas

    monkeypatch.setattr(blas, "_CHOSEN", {})
    return blas._CHOSEN


def test_products_off_cuda_run_as_torch_runs_them_and_choose_nothing(chosen):
    from worker.engines.native import blas

    layer = torch.nn.Linear(16, 8)
    x = torch.randn(5, 16)
    with blas.tuning():
        assert torch.equal(blas.linear(layer, x), layer(x))
    assert chosen == {}


def test_a_torch_that_cannot_run_the_split_says_so(monkeypatch):
    """blas.split is torch's bmm with fp32 outputs of half-precision inputs; an older torch has no
    such keyword and a backend may have no kernel for it: split_runs says so (and the capture then
    times no split, blas._fastest_parts) rather than the load failing."""
    from worker.engines.native import blas

    weight, x = torch.randn(8, 128, dtype=torch.bfloat16), torch.randn(3, 128, dtype=torch.bfloat16)

    def refused(error):
        def bmm(*args, **kwargs):
            raise error
        return bmm

    for error in (TypeError("bmm() got an unexpected keyword argument 'out_dtype'"),
                  RuntimeError("Could not run 'aten::bmm.dtype' with arguments from the 'CPU' backend")):
        monkeypatch.setattr(torch, "bmm", refused(error))
        assert not blas.split_runs(weight, x)
    monkeypatch.setattr(torch, "bmm", lambda a, b, out_dtype: torch.matmul(a.float(), b.float()).to(out_dtype))
    assert blas.split_runs(weight, x)
    assert blas.split(weight, x, 2).shape == (2, 3, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS runs on CUDA")
def test_a_shape_is_timed_once_while_tuning_never_while_a_graph_is_captured(chosen, monkeypatch):
    """Outside tuning() nothing is timed and torch's default runs; inside, the first product of a
    shape is timed and the choice runs it and every later one of that shape (cublasLt seen set while
    the product runs); a shape first met while a graph is captured takes the default, untimed."""
    from worker.engines.native import blas

    timed, seen = [], []
    monkeypatch.setattr(blas, "_faster", lambda layer, x: timed.append(x.shape) or "cublaslt")
    layer = torch.nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    layer.register_forward_hook(lambda *_: seen.append(torch.backends.cuda.preferred_blas_library()))
    default, lt = torch.backends.cuda.preferred_blas_library(), torch._C._BlasBackend.Cublaslt
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(blas.linear(layer, x), x @ layer.weight.t())
    assert timed == [] and seen == [default]
    with blas.tuning():
        for _ in range(2):
            torch.testing.assert_close(blas.linear(layer, x), x @ layer.weight.t())
    assert timed == [(64, 256)] and seen[1:] == [lt, lt]
    assert blas.linear(layer, x) is not None and seen[-1] == lt  # the choice stays
    assert torch.backends.cuda.preferred_blas_library() == default  # and is set only around the call
    other = torch.randn(48, 256, device="cuda", dtype=torch.bfloat16)
    blas.linear(layer, other)  # the shape's first cuBLAS call before the capture, as graphs.py runs each size first
    graph = torch.cuda.CUDAGraph()
    with blas.tuning(), torch.cuda.graph(graph):
        blas.linear(layer, other)
    assert timed == [(64, 256)] and seen[-1] == default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS runs on CUDA")
def test_timing_both_front_ends_leaves_the_default_in_place(chosen):
    from worker.engines.native import blas

    layer = torch.nn.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    default = torch.backends.cuda.preferred_blas_library()
    assert blas._faster(layer, torch.zeros(32, 1024, device="cuda", dtype=torch.bfloat16)) in blas.LIBRARIES
    assert torch.backends.cuda.preferred_blas_library() == default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS runs on CUDA")
def test_the_timing_counts_the_device_not_the_host_launching():
    """Five tiny kernels, each launched 3 ms after the call began: the graphs replay them without
    the host, so the choice must count ~microseconds, not the 15 ms the host took."""
    import time

    from worker.engines.native import blas

    x = torch.zeros(1, device="cuda")

    def slow_launch():
        time.sleep(0.003)  # the slow host under test (cublasLt's launch, magnified), not a wait
        x.add_(1)

    assert blas.device_ms(slow_launch, lambda: None, calls=5) < 1.0
    assert x.item() >= 5

"""Where the native engine on CUDA keeps the kernels Triton compiles: engine.kernel_dir's `triton`
folder (kernels.keep_compiled), the folder the image's cache volume holds across restarts."""

import pytest

from worker.engines.native import kernels


def test_triton_writes_its_compiled_kernels_under_the_kernel_dir(tmp_path):
    knobs = pytest.importorskip("triton").knobs
    from triton.runtime.cache import get_cache_manager

    with knobs.cache.scope():  # the process's setting back after the test
        before = knobs.cache.dir
        kernels.keep_compiled("")  # empty: Triton's own cache, untouched
        assert knobs.cache.dir == before
        kernels.keep_compiled(str(tmp_path / "kernels"))
        stored = get_cache_manager("ab" * 32).put(b"compiled", "kernel.cubin")
    assert stored.startswith(str(tmp_path / "kernels" / "triton"))
    assert [path.read_bytes() for path in (tmp_path / "kernels" / "triton").rglob("kernel.cubin")] == [b"compiled"]

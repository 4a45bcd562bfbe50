"""The native engine's C++ CPU kernels (worker/engines/native/csrc/) against the torch paths they
replace, built for every instruction set this CPU runs (an AVX-512 machine tests its AVX2 and plain
C++ builds too), and what the engine does where they cannot be built."""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from worker.config_loader import load_config
from worker.deps.hardware import isa_environment, runnable_isas, this_cpu
from worker.engines.native import kernels
from worker.engines.native.attention import decode_attention, gather_attention

pytestmark = pytest.mark.skipif(not shutil.which("c++"), reason="no C++ compiler: the kernels cannot be built here")
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")  # what a probe starts without
# The folder the engine tests' configs name, so one build serves the whole run.
KERNEL_DIR = load_config(None, {"HOME": "/tmp"}).engine.kernel_dir


@pytest.fixture(params=runnable_isas(*this_cpu()))
def built(request, monkeypatch):
    """The kernels of one ISA are what kernels.py's functions call for the test; the engine's after."""
    monkeypatch.setattr(kernels, "_active", kernels.active())
    assert kernels.load(KERNEL_DIR, request.param) == "built"
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 128), (4, 2, 48)],
                         ids=["smollm2", "mha-128", "odd-dim"])  # 48: the plain loops, not the AVX-512 path
def test_paged_decode_matches_the_gather_path(built, dtype, heads, kv_heads, dim):
    torch.manual_seed(0)
    block_size, blocks = 16, 128
    k = torch.randn(blocks * block_size, kv_heads, dim, dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.tensor([1, 15, 16, 17, 0, 300, 700], dtype=torch.int32)  # 0: a padding row, all zeros
    tables = torch.stack([torch.randperm(blocks)[:48] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), heads, dim, dtype=dtype)
    # Scores far apart too: the softmax's exponent must hold over a wide range.
    q[5] *= 30
    expected = gather_attention(q, k, v, tables, lens, block_size)
    out = decode_attention(q, k, v, tables, lens, block_size)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    assert not out[4].any()


def test_paged_decode_reads_a_transposed_query(built):
    """rope_and_store hands decode a view of q (split from one rotation of q and k)."""
    torch.manual_seed(1)
    k = torch.randn(64, 3, 64)
    v = torch.randn_like(k)
    q = torch.randn(2, 64, 12).transpose(1, 2)[:, :9]  # (2, 9, 64), not contiguous
    tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 32], dtype=torch.int32)
    torch.testing.assert_close(kernels.paged_decode(q, k, v, tables, lens, 16), gather_attention(q, k, v, tables, lens, 16))


def test_a_folder_that_cannot_be_written_says_why_and_leaves_the_torch_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "_active", None)
    monkeypatch.setattr(kernels, "_libraries", {})
    blocked = tmp_path / "file"
    blocked.write_text("")
    status = kernels.load(str(blocked / "kernels"), "default")
    assert status.startswith("not built: ") and "file" in status
    assert not kernels.loaded()
    assert kernels.load("", "default") == "off: engine.kernel_dir is empty"


def test_a_compiler_that_cannot_run_says_why_and_leaves_the_torch_paths(tmp_path):
    probe = f"from worker.engines.native import kernels; print(kernels.load({str(tmp_path)!r}, 'default'))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
                            env={**os.environ, "CXX": "false"})
    assert result.stdout.startswith("not built: ") and "false" in result.stdout, result.stderr[-2000:]


def test_a_lock_left_by_a_start_killed_in_the_build_holds_up_no_later_start():
    """torch's lock file in the build folder, as a worker killed while building leaves it (and no
    mark of a finished build): the next start clears it (under a flock of its own) instead of
    waiting on it forever, and marks the build finished."""
    isa = kernels.resolve("auto")
    assert kernels.load(KERNEL_DIR, isa) == "built"
    folder = kernels.build_folder(KERNEL_DIR, isa)
    (folder / kernels.BUILT).unlink()
    (folder / "lock").touch()
    probe = f"from worker.engines.native import kernels; print(kernels.load({KERNEL_DIR!r}, {isa!r}))"
    try:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    finally:
        stale = (folder / "lock").exists()
        (folder / "lock").unlink(missing_ok=True)
    assert result.stdout.split() == ["built"] and not stale, result.stderr
    assert (folder / kernels.BUILT).exists()


def test_a_finished_build_loads_as_is_in_another_environment_of_the_same_torch(tmp_path):
    """A new environment (CI's fresh clone, a virtualenv made again elsewhere) runs the same torch
    from another path: it finds the build by the same key and loads the library, compiling
    nothing (here no compiler would run: CXX is false)."""
    isa = kernels.resolve("auto")
    assert kernels.load(KERNEL_DIR, isa) == "built"
    (tmp_path / "torch").symlink_to(Path(torch.__file__).parent)
    probe = ("import torch; from worker.engines.native import kernels; "
             f"print(torch.__file__.startswith({str(tmp_path)!r}), kernels.build_folder({KERNEL_DIR!r}, {isa!r}), "
             f"kernels.load({KERNEL_DIR!r}, {isa!r}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}", "CXX": "false"})
    assert result.stdout.split() == ["True", str(kernels.build_folder(KERNEL_DIR, isa)), "built"], result.stderr[-2000:]


def test_an_isa_this_cpu_cannot_run_is_refused_and_auto_is_its_best():
    runnable = runnable_isas(*this_cpu())
    assert kernels.resolve("auto") == runnable[0] and runnable[-1] == "default"
    foreign = "neon" if this_cpu()[0] == "x86_64" else "avx2"
    with pytest.raises(ValueError, match=f"{foreign} does not run on this CPU; it runs {runnable[0]}"):
        kernels.resolve(foreign)


def test_an_isa_below_the_best_limits_onednn_and_aten_before_torch_starts():
    avx512 = frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
    assert isa_environment("avx2", "x86_64", avx512) == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                                                         "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert isa_environment("auto", "x86_64", avx512) == isa_environment("avx512", "x86_64", avx512) == {}
    assert isa_environment("avx2", "x86_64", avx512 - {"avx512f"}) == {}  # already the best: nothing to limit
    if "avx512" not in runnable_isas(*this_cpu()):
        return
    # What `cy-llm serve --set engine.cpu_isa=avx2` does first, in a process of its own.
    probe = ("from worker.cli import _limit_cpu_isa; _limit_cpu_isa('avx2'); import torch; "
             "print(torch.backends.cpu.get_cpu_capability(), torch.ops.mkldnn._is_mkldnn_bf16_supported())")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            env={k: v for k, v in os.environ.items() if k not in ISA_LIMITS})
    assert result.stdout.split() == ["AVX2", "False"]


def test_bf16_weights_without_onednn_bf16_run_widened_to_fp32_for_prompts():
    """Forced to AVX2, oneDNN has no bf16: PackedLinear keeps the bf16 weight, a few rows go through
    torch's bf16 GEMV and a prompt's through the fp32 GEMM of the widened weight."""
    if "avx2" not in runnable_isas(*this_cpu()):
        pytest.skip("this CPU has no AVX2")
    probe = f"""
from worker.cli import _limit_cpu_isa
_limit_cpu_isa("avx2")
import torch
from worker.engines.native import kernels
from worker.engines.native.linear import PackedLinear
assert kernels.load({KERNEL_DIR!r}, "avx2") == "built"
assert not PackedLinear.supports(torch.bfloat16)
torch.manual_seed(3)
linear = torch.nn.Linear(96, 200).bfloat16()
packed = PackedLinear(linear)
assert not packed.packed.is_mkldnn
x = torch.randn(3, 96).bfloat16()
torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, linear.weight, linear.bias), atol=0, rtol=0)
x = torch.randn(20, 96).bfloat16()
wide = torch.ops.mkldnn._reorder_linear_weight(linear.weight.float(), 20)
expected = torch.ops.mkldnn._linear_pointwise(x.float(), wide, linear.bias.float(), "none", [], "").bfloat16()
torch.testing.assert_close(packed(x), expected, atol=0, rtol=0)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k not in ISA_LIMITS})
    assert result.stdout.split()[-1:] == ["ok"], result.stderr[-3000:]


@pytest.mark.skipif(not shutil.which("aarch64-linux-gnu-g++"), reason="no arm64 cross compiler (.ci/run installs "
                    "Debian's g++-aarch64-linux-gnu)")
def test_the_neon_build_compiles_for_arm64(tmp_path):
    """The NEON path cannot run here; each source still compiles for armv8.2-a against torch's headers
    (the quantized dot products also with the dot-product instructions most arm64 servers have).
    The compilers run side by side: each spends ~10 s reading torch's headers (40-53 s for the eight
    on a 2-core EPYC; .ci/run puts ccache's compilers first on the PATH, which keeps them)."""
    include = Path(torch.__file__).parent / "include"
    builds = [(source, []) for source in kernels.SOURCES] + [(kernels.CSRC / "cpu_quant.cpp", ["-march=armv8.2-a+dotprod"])]

    def compile_one(index: int) -> str | None:
        source, extra = builds[index]
        out = tmp_path / f"{index}.o"
        result = subprocess.run(["aarch64-linux-gnu-g++", "-std=c++20", "-fPIC", "-isystem", str(include), "-isystem",
                                 str(include / "torch" / "csrc" / "api" / "include"), *kernels.compile_flags("neon"),
                                 *extra, "-c", str(source), "-o", str(out)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            return f"{source.name} {extra}: {result.stderr[-3000:]}"
        kind = subprocess.run(["file", str(out)], capture_output=True, text=True, check=False).stdout
        return None if "aarch64" in kind else f"{source.name} {extra}: not an arm64 object: {kind}"

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        failures = [failure for failure in pool.map(compile_one, range(len(builds))) if failure]
    assert not failures, "\n\n".join(failures)


def test_paged_decode_refuses_a_table_that_points_outside_the_cache(built):
    k = torch.randn(64, 3, 64)  # 4 blocks of 16
    q = torch.randn(1, 9, 64)
    with pytest.raises(RuntimeError, match="a block outside the cache"):
        kernels.paged_decode(q, k, k, torch.tensor([[0, 4]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), 16)
    with pytest.raises(RuntimeError, match="a context longer than its block table"):
        kernels.paged_decode(q, k, k, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([33], dtype=torch.int32), 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_the_torch_path(built, dtype):
    from worker.engines.native.elementwise import add_rms_norm, rms_norm

    torch.manual_seed(2)
    x, residual = torch.randn(2, 7, 576, dtype=dtype).unbind()
    weight = torch.randn(576, dtype=dtype)
    total, out = kernels.add_rms_norm(x, residual, weight, 1e-5)
    expected_total, expected = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(total, expected_total, atol=0, rtol=0)  # one rounding of the same sum
    # fp32: the sum of squares in another order, an ulp or so; bf16: the same roundings as HF's.
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(out, expected, **tolerance)
    first_total, first = kernels.add_rms_norm(x, None, weight, 1e-5)  # the first layer: no residual yet
    assert first_total.data_ptr() == x.data_ptr()
    torch.testing.assert_close(first, rms_norm(x, weight, 1e-5), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_matches_the_torch_path(built, dtype, monkeypatch):
    from worker.engines.native.rotary import rope_and_store
    from worker.engines.native.elementwise import rotate

    torch.manual_seed(3)
    tokens, heads, kv_heads, dim = 5, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)  # q, k and v are views of one row, as in the model
    q, k, v = (part.reshape(tokens, -1, dim) for part in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], 1))
    angles = torch.randn(tokens, 1, dim // 2) * 100
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.tensor([3, 17, 18, 40, 63])
    caches = [torch.zeros(64, kv_heads, dim, dtype=dtype) for _ in range(4)]
    q_out, k_out = rope_and_store(q, k, v, cos, sin, caches[0], caches[1], slots, rotate)
    monkeypatch.setattr(kernels, "_active", None)
    q_ref, k_ref = rope_and_store(q, k, v, cos, sin, caches[2], caches[3], slots, rotate)
    for out, expected in ((q_out, q_ref), (k_out, k_ref), (caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the same roundings, to the bit
    assert caches[0][slots].any() and not caches[0][[0, 1, 2]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_torch_path(built, dtype):
    from worker.engines.native.elementwise import silu_and_mul

    torch.manual_seed(4)
    size = 1000  # not a multiple of 16: the tail runs the plain loop
    wide = torch.randn(6, 2 * size + 24, dtype=dtype) * 4
    wide[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    gate_up = wide[:, :2 * size]  # rows further apart than their width
    # fp32: another exp than torch's, within a few ulps; bf16: the same rounding points, so at most
    # an ulp apart where the two exps straddle one.
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), silu_and_mul(gate_up), **tolerance)


def quantized_reference(x: torch.Tensor, linear) -> torch.Tensor:
    """csrc/cpu_quant.cpp's arithmetic in float64: x quantized per 32 inputs to s * p (p = x / s
    rounded, s = max |x| / 127), then per group d * s * (q . p) + m * s * sum(p)."""
    groups = x.double().view(x.shape[0], 1, -1, 32)
    s = groups.abs().amax(-1, keepdim=True) / 127
    p = torch.round(groups / torch.where(s > 0, s, 1) * torch.where(s > 0, 1, 0)) * s  # 127 / amax, as the kernel
    return (p * linear.dequantized().double().view(1, linear.packed.shape[0], -1, 32)).sum((-1, -2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linear_matches_its_arithmetic_in_float64(built, bits, dtype):
    """1 and 3 tokens (a tile of two and one of one) on 70 rows (a short last tile of four) give the
    integer dot products' result to float rounding; 20 tokens run a GEMM on the widened weight."""
    from worker.engines.native.linear import PackedLinear, QuantLinear

    torch.manual_seed(9)
    linear = torch.nn.Linear(96, 70)
    quantized = QuantLinear(linear, bits)
    for tokens in (1, 3):
        x = torch.randn(tokens, 96).to(dtype)
        x[0, :32] = 0  # an all-zero group: scale 0
        expected = (quantized_reference(x, quantized) + quantized.bias.double()).to(dtype)
        tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
        torch.testing.assert_close(quantized(x), expected, **tolerance)
    x = torch.randn(20, 96).to(dtype)
    if PackedLinear.supports(dtype):  # the GEMM of oneDNN in x's dtype, as torch's own linear runs it
        widened = torch.nn.functional.linear(x, quantized.dequantized().to(dtype), quantized.bias.to(dtype))
        torch.testing.assert_close(quantized(x), widened, atol=0, rtol=0)
    else:  # bf16 without oneDNN's: an fp32 GEMM (oneDNN's, not torch's: the sums' order may differ)
        widened = torch.nn.functional.linear(x.float(), quantized.dequantized(), quantized.bias).to(dtype)
        torch.testing.assert_close(quantized(x), widened, atol=1e-5, rtol=2 ** -7)


@pytest.mark.parametrize("variant", ["fp32", "bf16", "bf16-unpacked", "bf16-int4", "fp32-int4", "qwen2-bias"])
def test_decode_layers_match_the_layer_by_layer_path(built, variant, tiny_model, request, monkeypatch):
    """An all-decode step through kernels.decode_layers gives the logits and cache writes of the
    model's layers run one by one, to the bit: the same kernels in the same order. bf16-unpacked:
    the weights as PackedLinear keeps them where oneDNN has no bf16."""
    from worker.engines.native.linear import PackedLinear
    from worker.engines.native.batch import Batch
    from worker.engines.native.model import load_model

    folder = tiny_model("qwen2") if variant == "qwen2-bias" else request.getfixturevalue("embedded_model")
    dtype = torch.bfloat16 if variant.startswith("bf16") else torch.float32
    if variant == "bf16-unpacked":
        monkeypatch.setattr(PackedLinear, "supports", staticmethod(lambda dtype: dtype == torch.float32))
    model = load_model(folder, dtype, torch.device("cpu"), "int4" if variant.endswith("int4") else "none")
    assert model.decode_weights is not None
    if not variant.endswith("int4"):  # packed wherever oneDNN runs the dtype
        packed = variant != "bf16-unpacked" and PackedLinear.supports(dtype)
        assert model.layers[0].mlp.down_proj.packed.is_mkldnn == packed
    c, block_size = model.config, 16
    torch.manual_seed(6)
    caches = torch.randn(2, c.num_layers, 64 * block_size, c.num_kv_heads, c.head_dim).to(dtype)
    contexts = [1, 17, 200]
    tables = torch.randperm(64)[:3 * 13].view(3, 13).tolist()
    slots = [tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(contexts)]

    def step(k, v):
        batch = Batch(torch.tensor([5, 77, 300]), torch.tensor(contexts) - 1, torch.tensor(slots), [1, 1, 1], contexts,
                      tables, torch.arange(3), block_size)
        return model(batch, k, v)

    k, v = caches.clone()
    logits = step(k, v)
    stacked, model.decode_weights = model.decode_weights, None
    k_ref, v_ref = caches.clone()
    expected = step(k_ref, v_ref)
    assert stacked is not None
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    torch.testing.assert_close((k, v), (k_ref, v_ref), atol=0, rtol=0)
    assert not torch.equal(k, caches[0])

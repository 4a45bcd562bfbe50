"""The native engine's C++ kernels for CPUs (csrc/), compiled on first use for the CPU that runs them;
and where Triton keeps the kernels it compiles for GPUs (keep_compiled).

One source over ATen's vector type (csrc/vec.h), built once per instruction set (engine.cpu_isa):
avx512 (x86-64-v4), avx2 (x86-64-v3), neon (armv8.2-a) or default (plain C++), each a library of
its own whose ops are torch.ops.cyllm_<isa>.*; auto takes the CPU's best. torch's cpp_extension
builds them with the machine's C++ compiler and ninja (~10 s on 2 cores) into `engine.kernel_dir`,
one folder per torch build, CPU, source and ISA with its flags: `-mtune=native` ties the binary to
the CPU, and a cache folder may be shared by several machines (a volume, a home directory on NFS) or
by two versions of cy-llm, which would otherwise rebuild over each other's library. A finished
build leaves a mark (BUILT); later starts load its library as is, in milliseconds, from whichever
environment of that torch build they run in (a new clone's or virtualenv's included). Where
nothing can be built (no compiler, or one that cannot run), the engine runs the plain torch paths
of attention.py and elementwise.py, layer by layer from model.py, which give the same greedy tokens
(tests/test_native_engine.py runs both against HF) more slowly.

- paged_decode(q, k_cache, v_cache, tables, lens, block_size, scale): decode attention read in
  place from the paged cache (csrc/cpu_attention.cpp).
- add_rms_norm(x, residual, weight, eps): the residual add and RMS norm of every layer in one pass
  (csrc/cpu_norm.cpp).
- rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots): rotary embedding of q and k and the
  cache writes of k and v (csrc/cpu_rope.cpp).
- silu_and_mul(gate_up): the MLP's activation (csrc/cpu_activation.cpp).
- unpacked_linear(x, weight, bias), quantized_linear(x, weight, scales, bias): linear layers with a
  bf16 weight oneDNN does not run, or with 4- or 8-bit weights (csrc/cpu_linear.cpp).
- decode_layers(...): every decoder layer of an all-decode step in one call, out of the kernels
  above and the linear layers' ops (csrc/cpu_decoder.cpp).
"""

from __future__ import annotations

import fcntl
import hashlib
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.config import ConfigError
from worker.deps.hardware import runnable_isas, this_cpu
from worker.telemetry import get_logger

log = get_logger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / f"cpu_{name}.cpp" for name in ("attention", "norm", "rope", "activation", "linear", "quant", "decoder")]
HEADERS = [CSRC / "ops.h", CSRC / "vec.h"]
LINK_FLAGS = ("-fopenmp",)  # a tuple: torch's build appends to the lists it is given
BUILT = "built"  # written in a build folder once its library is complete
# Per ISA: the compiler's target, and the CPU_CAPABILITY that picks ATen's vector implementation
# (NEON's comes with the default one on aarch64).
TARGETS = {"avx512": (["-march=x86-64-v4", "-mtune=native"], "AVX512"),
           "avx2": (["-march=x86-64-v3", "-mtune=native"], "AVX2"),
           "neon": (["-march=armv8.2-a"], "DEFAULT"),
           "default": ([], "DEFAULT")}
_libraries: dict[str, Any] = {}  # ISA -> its torch.ops namespace, once built and loaded
_active: str | None = None  # the ISA whose ops the functions below call


def resolve(setting: str) -> str:
    """engine.cpu_isa -> the ISA to build: auto is the CPU's best; one it cannot run is refused."""
    runnable = runnable_isas(*this_cpu())
    if setting == "auto":
        return runnable[0]
    if setting not in runnable:
        raise ValueError(f"{setting} does not run on this CPU; it runs {', '.join(runnable)}")
    return setting


def compile_flags(isa: str) -> list[str]:
    target, capability = TARGETS[isa]
    # csrc/cpu_linear.cpp's byte dot products in one instruction, where this CPU has it.
    if isa == "avx512" and "avx512_vnni" in this_cpu()[1]:
        target = [*target, "-mavx512vnni"]
    if isa == "neon" and "asimddp" in this_cpu()[1]:
        target = ["-march=armv8.2-a+dotprod"]
    # -fopenmp: at::parallel_for is inline OpenMP code; the library then uses the libgomp torch loaded.
    # -ffp-contract=off: a * b + c stays two roundings, as in torch's ops (intrinsics still fuse).
    return ["-O3", *target, "-ffp-contract=off", "-fopenmp", f"-DCPU_CAPABILITY={capability}",
            f"-DCPU_CAPABILITY_{capability}", f"-DCYLLM_OPS=cyllm_{isa}"]


def load(kernel_dir: str, isa: str) -> str:
    """Builds (or finds built) and registers torch.ops.cyllm_<isa>.*, whose ops the functions below
    then call: "built", or why not (no compiler, no ninja, a build error: its first line that says
    error)."""
    global _active
    if not kernel_dir:
        return "off: engine.kernel_dir is empty"
    if isa not in _libraries:
        try:
            from torch.utils.cpp_extension import load as build

            folder = build_folder(kernel_dir, isa)
            library = folder / f"cyllm_cpu_{isa}.so"
            if (folder / BUILT).exists():
                torch.ops.load_library(str(library))
            else:
                folder.mkdir(parents=True, exist_ok=True)
                with open(folder / "build.flock", "a") as held:
                    # torch's own lock is a file that its holder deletes: one killed while building
                    # leaves it, and every later start waits on it forever. The OS drops a flock
                    # however its holder ends, and while this one holds it no other start is in
                    # torch's build here: a lock file is stale.
                    fcntl.flock(held, fcntl.LOCK_EX)
                    (folder / "lock").unlink(missing_ok=True)
                    build(name=f"cyllm_cpu_{isa}", sources=[str(s) for s in SOURCES], build_directory=str(folder),
                          is_python_module=False, extra_cflags=compile_flags(isa), extra_ldflags=list(LINK_FLAGS))
                    (folder / BUILT).touch()
        # (a compiler that fails to run at all: torch's check of its version raises CalledProcessError)
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as exc:
            lines = str(exc).strip().splitlines()
            errors = [line.strip() for line in lines if "error" in line.lower()]  # a compiler's first error says most
            return f"not built: {(errors or lines or [type(exc).__name__])[0]}"
        _libraries[isa] = getattr(torch.ops, f"cyllm_{isa}")
    _active = isa
    return "built"


def load_configured(kernel_dir: str, cpu_isa: str) -> str:
    """load() for engine.kernel_dir and engine.cpu_isa (auto, or an ISA this CPU runs)."""
    try:
        outcome = load(kernel_dir, resolve(cpu_isa))
    except ValueError as exc:
        raise ConfigError("engine.cpu_isa", str(exc)) from exc
    if outcome.startswith("not built"):
        log.warning("CPU kernels not built; the torch paths run instead", reason=outcome, kernel_dir=kernel_dir)
    return outcome


def keep_compiled(kernel_dir: str) -> None:
    """Triton's compiled GPU kernels kept in engine.kernel_dir too (its `triton` folder), which the
    compose stack's and the pod's cache volume keep across the worker's restarts; empty: Triton's
    own cache (~/.triton). Most of a cold start on CUDA is compiling them: a 1B engine of 256 rows
    was ready in 30-38 s with Triton's cache empty and in 7-11 s with it full (H200,
    docs/benchmarks.md)."""
    if not kernel_dir:
        return
    try:
        from triton import knobs
    except ImportError:  # no Triton (CPU installs), or one without knobs (before 3.4): its own cache
        return
    knobs.cache.dir = str(Path(kernel_dir) / "triton")


def loaded() -> bool:
    return _active is not None


def active() -> str | None:
    """The ISA whose kernels run, None before one is loaded."""
    return _active


def _ops() -> Any:
    return _libraries[_active]


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """attention.decode_attention's contract: q (B, H, D); tables (B, max_blocks) int32; lens (B,)."""
    return _ops().paged_decode(q.contiguous(), k_cache, v_cache, tables, lens.to(torch.int32), block_size,
                                        q.shape[-1] ** -0.5)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """elementwise.add_rms_norm's contract (x + residual, its norm); residual None: (x, norm of x)."""
    return _ops().add_rms_norm(x, residual, weight, eps)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attention.rope_and_store's contract; cos and sin (T, 1, D)."""
    tokens, dim = q.shape[0], q.shape[-1]
    return _ops().rope_and_store(q, k, v, cos.reshape(tokens, dim), sin.reshape(tokens, dim), k_cache, v_cache,
                                          slots)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """elementwise.silu_and_mul's contract: gate_up (T, 2I) -> (T, I)."""
    return _ops().silu_and_mul(gate_up)


def unpacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """linear.PackedLinear's weight where oneDNN does not run its dtype: x (..., in) -> (..., out)."""
    flat = x.reshape(-1, x.shape[-1])
    return _ops().unpacked_linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """linear.QuantLinear's layout: x (..., in) times the 4- or 8-bit weight -> (..., out)."""
    flat = x.reshape(-1, x.shape[-1])
    return _ops().quantized_linear(flat, weight, scales, bias).view(*x.shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class LayerWeights:
    """What decode_layers reads of a model's decoder layers, gathered once at load."""

    norms: list[torch.Tensor]  # 2 a layer: input, post-attention
    weights: list[torch.Tensor]  # 4 a layer (qkv, o, gate_up, down), as linear.py's layers keep them
    scales: list[torch.Tensor | None]  # QuantLinear's scales; None: a PackedLinear
    biases: list[torch.Tensor | None]
    heads: int
    eps: float


def decode_layers(x: torch.Tensor, layers: LayerWeights, k_caches: torch.Tensor, v_caches: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers of a step whose T tokens are all decodes: x (T, hidden) embedded; cos and
    sin (T, 1, D); caches (layers, slots, kv_heads, D). Returns (last MLP output, residual)."""
    tokens, dim = x.shape[0], k_caches.shape[-1]
    return _ops().decode_layers(x, layers.norms, layers.weights, layers.scales, layers.biases, k_caches,
                                         v_caches, cos.reshape(tokens, dim), sin.reshape(tokens, dim), slots, tables,
                                         lens, layers.heads, block_size, layers.eps)


def build_folder(kernel_dir: str, isa: str) -> Path:
    """Where `isa`'s library is built: named for the torch build (its version and commit: the
    headers and the libraries it links), the CPU's model and instruction-set flags, the sources
    and the compiler's flags. Not for where torch is installed: a build is loaded as is wherever
    the same torch runs (before, each new environment, as CI's fresh clone makes, built again)."""
    return Path(kernel_dir) / f"torch-{torch.__version__}-{_build_key(isa)}" / isa


def _build_key(isa: str) -> str:
    described = platform.machine() + str(torch.version.git_version) + " ".join([*compile_flags(isa), *LINK_FLAGS])
    try:
        with open("/proc/cpuinfo") as info:
            lines = info.read().split("\n\n")[0].splitlines()
        described += "".join(line for line in lines if line.startswith(("model name", "flags")))
    except OSError:
        described += platform.processor()
    digest = hashlib.sha256(described.encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]

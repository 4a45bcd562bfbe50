"""The native engine's C++ kernels for CPUs (csrc/), compiled on first use for the CPU that runs them.

torch's cpp_extension builds them with the machine's C++ compiler and ninja (~10 s on 2 cores) into
`engine.kernel_dir`, one folder per torch install, CPU and source: `-march=native` ties the binary to
the CPU, and a cache folder may be shared by several machines (a volume, a home directory on NFS) or
by two versions of cy-llm, which would otherwise rebuild over each other's library. Later starts
load the built library in milliseconds. Where nothing can be built (no compiler), the engine runs
the plain torch paths of attention.py and elementwise.py, layer by layer from model.py, which give
the same greedy tokens (tests/test_native_engine.py runs both against HF) more slowly.

- torch.ops.cyllm.paged_decode(q, k_cache, v_cache, tables, lens, block_size, scale): decode
  attention read in place from the paged cache (csrc/cpu_attention.cpp).
- torch.ops.cyllm.add_rms_norm(x, residual, weight, eps): the residual add and RMS norm of every
  layer in one pass (csrc/cpu_norm.cpp).
- torch.ops.cyllm.rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots): rotary embedding of q
  and k and the cache writes of k and v (csrc/cpu_rope.cpp).
- torch.ops.cyllm.silu_and_mul(gate_up): the MLP's activation (csrc/cpu_activation.cpp).
- torch.ops.cyllm.decode_layers(...): every decoder layer of an all-decode step in one call, out of
  the kernels above and the linear layers' ops (csrc/cpu_decoder.cpp).
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / f"cpu_{name}.cpp" for name in ("attention", "norm", "rope", "activation", "decoder")]
HEADERS = [CSRC / "ops.h", CSRC / "vec.h"]
_loaded = False


def load(kernel_dir: str) -> str:
    """Builds (or finds built) and registers torch.ops.cyllm.*: "built", or why not (no compiler,
    no ninja, a build error: its first line that says error)."""
    global _loaded
    if _loaded:
        return "built"
    if not kernel_dir:
        return "off: engine.kernel_dir is empty"
    try:
        from torch.utils.cpp_extension import load as build

        folder = Path(kernel_dir) / f"torch-{torch.__version__}-{_build_key()}"
        folder.mkdir(parents=True, exist_ok=True)
        # -fopenmp: at::parallel_for is inline OpenMP code; the library then uses the libgomp torch loaded.
        # -ffp-contract=off: a * b + c stays two roundings, as in torch's ops (intrinsics still fuse).
        build(name="cyllm_cpu", sources=[str(s) for s in SOURCES], build_directory=str(folder), is_python_module=False,
              extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except (RuntimeError, OSError, ImportError) as exc:
        lines = str(exc).strip().splitlines()
        errors = [line.strip() for line in lines if "error" in line.lower()]  # a compiler's first error says most
        return f"not built: {(errors or lines or [type(exc).__name__])[0]}"
    _loaded = True
    return "built"


def loaded() -> bool:
    return _loaded


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """attention.decode_attention's contract: q (B, H, D); tables (B, max_blocks) int32; lens (B,)."""
    return torch.ops.cyllm.paged_decode(q.contiguous(), k_cache, v_cache, tables, lens.to(torch.int32), block_size,
                                        q.shape[-1] ** -0.5)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """elementwise.add_rms_norm's contract (x + residual, its norm); residual None: (x, norm of x)."""
    return torch.ops.cyllm.add_rms_norm(x, residual, weight, eps)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attention.rope_and_store's contract; cos and sin (T, 1, D)."""
    tokens, dim = q.shape[0], q.shape[-1]
    return torch.ops.cyllm.rope_and_store(q, k, v, cos.reshape(tokens, dim), sin.reshape(tokens, dim), k_cache, v_cache,
                                          slots)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """elementwise.silu_and_mul's contract: gate_up (T, 2I) -> (T, I)."""
    return torch.ops.cyllm.silu_and_mul(gate_up)


@dataclass(frozen=True)
class LayerWeights:
    """What decode_layers reads of a model's decoder layers, gathered once at load."""

    norms: list[torch.Tensor]  # 2 a layer: input, post-attention
    weights: list[torch.Tensor]  # 4 a layer (qkv, o, gate_up, down), as linear.py's layers keep them
    scales: list[torch.Tensor | None]  # Int4Linear's scales; None: a PackedLinear
    biases: list[torch.Tensor | None]
    heads: int
    eps: float
    group: int  # inputs per int4 scale


def decode_layers(x: torch.Tensor, layers: LayerWeights, k_caches: torch.Tensor, v_caches: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers of a step whose T tokens are all decodes: x (T, hidden) embedded; cos and
    sin (T, 1, D); caches (layers, slots, kv_heads, D). Returns (last MLP output, residual)."""
    tokens, dim = x.shape[0], k_caches.shape[-1]
    return torch.ops.cyllm.decode_layers(x, layers.norms, layers.weights, layers.scales, layers.biases, k_caches,
                                         v_caches, cos.reshape(tokens, dim), sin.reshape(tokens, dim), slots, tables,
                                         lens, layers.heads, block_size, layers.eps, layers.group)


def _build_key() -> str:
    """A digest of the CPU's model and instruction-set flags, of the sources, and of where torch is
    installed (two environments with one torch version build against different include paths, and
    sharing a folder, rebuilt it each time the other had run)."""
    described = platform.machine() + str(Path(torch.__file__).parent)
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

"""Which of cuBLAS's two front ends runs a product that goes to cuBLAS on CUDA.

torch sends a bf16 product to cublasGemmEx ("cublas", its default) or to cublasLt ("cublaslt"),
and each picks its own kernel for a shape: on an H200 (one product over 8 copies of its weight in a
CUDA graph, us) the Llama-8B shape's down projection (K 14,336) took 31.4 against 34.2 at 32 rows,
32.2 / 36.6 at 64 and 58.2 / 66.6 at 256 through cublasLt, but 42.7 against 39.1 at 128; SmolLM2's
qkv projection at 256 rows 5.20 against 4.11; most others within 2%. No rule of shapes fits that,
so the decode graphs' capture times both for each product and row count (`tuning`) and keeps the
faster. Products run eagerly (prompts) take the choice made for their row count, where a graph's
capture made one, else torch's default.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

LIBRARIES = ("cublas", "cublaslt")
MARGIN = 0.03
"""cublasLt is kept only where it is this much faster; within it, torch's default stays."""
ROUNDS, CALLS = 3, 10

_CHOSEN: dict[tuple, str] = {}
_TUNING = False


@contextlib.contextmanager
def tuning():
    """Products run inside choose their front end by timing both (eagerly: not while a graph is captured)."""
    global _TUNING
    before, _TUNING = _TUNING, True
    try:
        yield
    finally:
        _TUNING = before


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x), through the front end chosen for its shape (on CUDA; elsewhere as torch does)."""
    if not x.is_cuda:
        return layer(x)
    key = (x.device, x.dtype, x.shape[0], *layer.weight.shape, layer.bias is not None)
    library = _CHOSEN.get(key)
    if library is None and _TUNING and not torch.cuda.is_current_stream_capturing():
        library = _CHOSEN[key] = _faster(layer, x)
    if library is None or library == LIBRARIES[0]:
        return layer(x)
    with _library(library):
        return layer(x)


@contextlib.contextmanager
def _library(name: str):
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _faster(layer: nn.Linear, x: torch.Tensor) -> str:
    """Both front ends timed on random rows of x's shape (zeros, as the graphs' buffers hold at
    capture, draw less power and run faster), alternated, the median of each one's rounds; each call
    after twice the L2's bytes are written, so that it reads the weight from memory, as a step's
    layers do (the 1B shape's down projection, 32 MiB, ran from the L2 when timed back to back,
    where cublasLt looked faster at 64 rows; in the graph it was the slower)."""
    rows = torch.randn_like(x)
    flush = torch.empty(2 * torch.cuda.get_device_properties(x.device).L2_cache_size, dtype=torch.uint8,
                        device=x.device)
    times: dict[str, list[float]] = {name: [] for name in LIBRARIES}
    for _ in range(ROUNDS):
        for name in LIBRARIES:
            events = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)) for _ in range(CALLS)]
            with _library(name):
                layer(rows)
                for start, end in events:
                    flush.zero_()
                    start.record()
                    layer(rows)
                    end.record()
            events[-1][1].synchronize()
            times[name].append(sum(start.elapsed_time(end) for start, end in events))
    default, other = (sorted(times[name])[ROUNDS // 2] for name in LIBRARIES)
    return LIBRARIES[1] if other < default * (1 - MARGIN) else LIBRARIES[0]

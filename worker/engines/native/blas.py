"""Which of cuBLAS's two front ends runs a product that goes to cuBLAS on CUDA, and whether one
whose output a norm kernel adds to the residual stream runs in parts along K (`parts`).

torch sends a bf16 product to cublasGemmEx ("cublas", its default) or to cublasLt ("cublaslt"),
and each picks its own kernel for a shape: on an H200 (one product over 8 copies of its weight in a
CUDA graph, us) the Llama-8B shape's down projection (K 14,336) took 31.4 against 34.2 at 32 rows,
32.2 / 36.6 at 64 and 58.2 / 66.6 at 256 through cublasLt, but 42.7 against 39.1 at 128; SmolLM2's
qkv projection at 256 rows 5.20 against 4.11; most others within 2%. In a later session's graphs
(16 layers after the kernel before them) that down projection took 55.9 through cublasLt against
53.2 at 256 rows, and the 1B shape's 20.4 against 24.2 at 192. No rule of shapes fits that, so the
decode graphs' capture times both for each product and row count (`tuning`) and keeps the faster.
Products run eagerly (prompts) take the choice made for their row count, where a graph's capture
made one, else torch's default.

Past few_rows' rows (64) an o or down projection of few outputs gives cuBLAS few tiles to spread
over the SMs: the Llama-1B shape's down projection (2,048 x 8,192) at 256 rows is 32 tiles of 128 x
128, each down all of K. Its K split in parts, one strided-batched GEMM with fp32 outputs (`split`),
the norm kernel after it adds the parts as it adds few_rows' (elementwise._norm_triton). On an H200,
each product and its norm kernel over 16 (1B), 8 or 4 (8B) layers' weights in a CUDA graph, us a
layer at 128 / 192 / 256 rows, whole against the fastest of 2 and 4 parts: 1B down 18.2 / 23.9 /
24.6 against 16.9 / 18.3 / 21.3, 8B down 39.4 / 47.9 / 51.1 against 37.6 / 41.1 / 50.5, 8B o
16.7 / 21.3 / 21.0 against 16.1 / 17.8 / 20.6; the 1B o 8.1 / 8.8 / 9.1 against 8.2 / 8.9 / 9.6.
No rule of shapes fits that either, so the capture times each way too.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

LIBRARIES = ("cublas", "cublaslt")
MARGIN = 0.03
"""cublasLt is kept only where it is this much faster; within it, torch's default stays."""
ROUNDS, CALLS = 3, 10
HOLD_CYCLES = 2_000_000
"""The spin that holds the stream while a timing's calls are queued (~1 ms), longer where that was short."""

SPLITS = (2, 4)
"""The parts along K `parts` times besides the whole product; each part's K a multiple of SPLIT_K."""
SPLIT_K = 64

_CHOSEN: dict[tuple, str] = {}
_PARTS: dict[tuple, int] = {}
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


def parts(layer: nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> int:
    """How many parts along K x's product runs in, its output going to the norm kernel that adds it
    to `residual`: 1, through linear(), or SPLITS' (split()). Chosen while tuning by timing that
    kernel after the product each way (a split kept where it is MARGIN faster); elsewhere the choice
    made for its shape and row count, or 1. Half precision only, no bias, x and the weight
    contiguous (split() views them in parts)."""
    n, k = layer.weight.shape
    if (layer.bias is not None or x.dtype not in (torch.bfloat16, torch.float16) or x.stride() != (k, 1)
            or not layer.weight.is_contiguous()):
        return 1
    key = (x.device, x.dtype, x.shape[0], n, k)
    chosen = _PARTS.get(key)
    if chosen is None and _TUNING and not torch.cuda.is_current_stream_capturing():
        chosen = _PARTS[key] = _fastest_parts(layer, x, residual)
    return chosen or 1


def split(weight: torch.Tensor, x: torch.Tensor, parts: int) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T as (parts, M, N) fp32, the products of K's parts, in one
    strided-batched GEMM over views of x and the weight."""
    (m, k), n = x.shape, weight.shape[0]
    return torch.bmm(x.view(m, parts, k // parts).transpose(0, 1), weight.view(n, parts, k // parts).permute(1, 2, 0),
                     out_dtype=torch.float32)


def split_runs(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether this torch runs split() for x's dtype on x's device: an older torch has no `out_dtype`
    for bmm (TypeError), a backend may have no kernel for it (a RuntimeError)."""
    try:
        split(weight, x[:1], SPLITS[0])
    except (TypeError, RuntimeError):
        return False
    return True


def _fastest_parts(layer: nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> int:
    """parts()'s choice: each way timed with the norm kernel after it (elementwise's), as _faster
    times a product (_medians); 1 untimed where split() does not run (split_runs)."""
    from worker.engines.native.elementwise import _norm_triton

    rows, weight = torch.randn_like(x), torch.ones(layer.weight.shape[0], dtype=x.dtype, device=x.device)
    k = layer.weight.shape[1]
    ways = [1] + [count for count in SPLITS if k % (count * SPLIT_K) == 0]
    if len(ways) == 1 or not split_runs(layer.weight, rows):
        return 1
    median = _medians({count: (lambda count=count: _norm_triton(split(layer.weight, rows, count) if count > 1
                                                                else linear(layer, rows), residual, weight, 1e-6))
                       for count in ways}, x.device)
    fastest = min(median, key=median.get)
    return fastest if median[fastest] < median[1] * (1 - MARGIN) else 1


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
    capture, draw less power and run faster), alternated, the median of each one's rounds.
    Before each call twice the L2's bytes are read, so that the product reads its weight from
    memory, as a step's layers do (the 1B shape's down projection, 32 MiB, ran from the L2 when
    timed back to back, where cublasLt looked faster at 64 rows; in the graph it was the
    slower). Read, not written: a flush that wrote them left the L2 full of lines to write back
    while the product read its weight, and with the host's launches counted too (device_ms) the
    picks went either way from one load to the next and against the graphs: on an H200, in a
    graph of 16 layers after the kernel before them, the 1B shape's down projection at 64 rows
    took 15.2 us a layer through cuBLAS and 16.7 through cublasLt, and a load that picked
    cublasLt for it ran the bench's batch 64 at 1.185 ms a step against 1.163; at 192 rows
    cublasLt took 20.3-20.5 against 24.2-24.7 and one to three timings in five picked it. Now,
    five timings each of every product of the 1B and 8B shapes at 32-256 rows: each pick the
    graph's faster where the two differ by more than MARGIN (1B down at 192 rows and the 8B o at
    32, 96 and 192 cublasLt, 5/5; the 8B down at 256 cuBLAS, 5/5), but the 8B down at 32 rows,
    3.1% apart, cuBLAS four times in five."""
    rows = torch.randn_like(x)

    def through(name: str) -> torch.Tensor:
        with _library(name):
            return layer(rows)

    default, other = _medians({name: lambda name=name: through(name) for name in LIBRARIES}, x.device).values()
    return LIBRARIES[1] if other < default * (1 - MARGIN) else LIBRARIES[0]


def _medians(runs: dict, device: torch.device) -> dict:
    """Each of `runs` timed by device_ms ROUNDS times, alternated, each call after twice the L2's
    bytes are read (_faster says why): the median ms of each, in the order of `runs`."""
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8, device=device)
    times: dict = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            run()
            times[name].append(device_ms(run, flush.amax))
    return {name: sorted(spent)[ROUNDS // 2] for name, spent in times.items()}


def device_ms(run, before, calls: int = CALLS, hold: int = HOLD_CYCLES) -> float:
    """The device's time for `calls` runs of `run`, each after `before`, in ms: the stream is held
    by a spin kernel while they are queued, so that no call waits for the host to launch it, as
    none does in the graphs that replay them (timed with the device free, each call's time took in
    its launch, cublasLt's the longer: it builds descriptors and asks its heuristic every call).
    Where the hold ended before the last call was queued, it runs again with a longer one. The
    device waits out the queueing: on an H200 the 1B shape's engine (70 timings) loaded in 2.4-2.5 s
    against 1.9-2.1 timed the old way (warm, three loads each, alternated)."""
    while True:
        events = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)) for _ in range(calls)]
        held = torch.cuda.Event()
        torch.cuda._sleep(hold)
        held.record()
        for start, end in events:
            before()
            start.record()
            run()
            end.record()
        queued_in_time = not held.query()
        events[-1][1].synchronize()
        if queued_in_time:
            return sum(start.elapsed_time(end) for start, end in events)
        hold *= 4

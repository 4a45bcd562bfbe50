"""The linear products of a few rows on CUDA (2-64: a decode step of a small batch, a short prompt),
as a Triton kernel whose programs each stream their rows of the weight once for every row of x, in
half precision, launched with PDL (pdl.py) so that its first tile of W is read while the kernel
before it runs. Which rows and products take it, and in which tiles, is few_rows_config's choice
from the tables here; linear.RowLinear routes a product to it. Between layers it can hand the
residual stream on to the next product without the norm kernel between them (HANDOFF_MOST_ROWS),
and where it does not, give a product in parts along K for the norm kernel to add (FEW_ROWS_SPLIT).
"""

from __future__ import annotations

import torch

from worker.engines.native import pdl
from worker.engines.native.gemv import for_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton
    triton = None


FEW_ROWS = (32, 256, 4, 5)
FEW_ROWS_WIDE = (64, 128, 4, 5)
"""few_rows' (bn, bk, warps, stages): the fastest at 16 rows for the Llama-1B shapes on an H100, each after
a norm kernel and launched with PDL (us, cuBLAS's in brackets): qkv 8.1 (8.6), o 7.1 (7.5), down 17.1
(17.5), lm_head 180 (193); the wide one for gate_up, 27.2 (28.4). At 64 rows cuBLAS was as fast or
faster (down 18.7 against 19.7), so more rows go to it."""
FEW_ROWS_NARROW = {"H200": (2048, 8, (16, 256, 4, 5))}
"""By a part of the device's name: (widest N, most rows, config) for products of at most that many
outputs and rows. On an H200, the Llama-1B shape's down projection (2,048 x 8,192) and o (2,048 x
2,048), each over 16 layers' weights in a CUDA graph with PDL, us a layer at 2 / 8 / 16 rows: down
12.98 / 13.00 / 13.10 against FEW_ROWS' 15.77 / 15.82 / 13.58 (7.82 of bytes), o 5.02 / 5.08 / 5.26
against 5.44 / 5.48 / 5.46 (1.96): 64 programs of 32 outputs leave half the SMs idle. Through the
engine (two engines alternated in one process, three rounds) a step took 1.072 / 1.080 / 1.096 ms
against 1.094 / 1.103 / 1.122 at batch 2 / 4 / 8, but 1.104 against 1.089 at 16, which keeps
FEW_ROWS. qkv (3,072) and gate_up (16,384) were fastest with their own."""


FEW_ROWS_LIMIT = 64
"""Most rows the few_rows kernel takes at all (its rows are one tile); no table may give it more."""
FEW_ROWS_MOST = 16
"""Most rows few_rows takes on any device; more go to cuBLAS where FEW_ROWS_MANY has no entry."""
FEW_ROWS_MANY = {"H200": (2048, ((32, (32, 256, 4, 4), (128, 128, 4, 4)), (64, (32, 128, 4, 4), (64, 64, 4, 4))))}
"""By a part of the device's name, past FEW_ROWS_MOST rows: (deepest K, ((most rows, config for
fewer than 8,192 outputs, config for 8,192 to 65,535), ...)); other products go to cuBLAS. On an
H200 the Llama-1B shape's qkv, o and gate_up, each after a norm kernel in a CUDA graph, were as
fast as cuBLAS's at 32 and 64 rows (us a layer at 64: 8.09 / 7.69 / 20.68 against 7.86 / 7.38 /
20.83), the down projection and the LM head slower; through the engine (two engines alternated in
one process, three rounds) a step took 1.177 / 1.231 / 1.280 ms at batch 32 / 48 / 64 against
1.205 / 1.271 / 1.305 with them through cuBLAS: PDL overlaps their launches as it does the
kernels' around them."""
HANDOFF_MOST_ROWS = 32
"""Most rows whose o and down projections hand the residual stream on through few_rows' kernel,
for the qkv and gate/up projections after them to take their norm without its kernel (model.plus,
linear.RowLinear.adding / after_norm): the product's kernel adds the stream, sums each row's squares
over its columns and writes the sum times the next norm's weight; the next one reads that as its x,
unchanged, and scales each row of its sums by 1 / rms. A norm applied to x's tiles inside the
product's loop instead (as gemv's one row takes it) was slower: x then goes through registers, out
of the loop's pipelined loads (on an H200, the Llama-1B shape's engines alternated in one process,
ms a step: batch 16 1.026 -> 1.124, 2 1.041 -> 1.155, 64 1.166 -> 1.270). This way (three rounds):
batch 2 / 8 / 16 / 32 1.0445 / 1.0730 / 1.0281 / 1.0982 -> 1.0240 / 1.0485 / 1.0122 / 1.0905, but
64 1.1790 -> 1.1880; the LM head taking the final norm so too, 1.0320 / 1.0604 / 1.0200 / 1.0937
(its 4,008 programs each read the sums of squares). Past 32 rows, the products split along K
(FEW_ROWS_SPLIT) handing on from each program's last part were slower too (device floors at batch
40 / 48 / 64 1.068 / 1.079 / 1.111 -> 1.119 / 1.130 / 1.174 ms, docs/benchmarks.md)."""
FEW_ROWS_DEEPEST = {"H200": 4096}
"""By a part of the device's name: the deepest K few_rows takes whole; deeper products go to cuBLAS
or in parts (FEW_ROWS_SPLIT). On an H200 those are the Llama-8B and 1B shapes' down projections
(4,096 x 14,336, 2,048 x 8,192). 8B: three engines alternated in one process, three rounds, a step
took 4.614 / 4.712 ms at batch 8 / 16 with it through cuBLAS against 4.761 / 4.944 through few_rows,
and 4.672 / 4.772 with every product through cuBLAS. 1B: no faster so alone (1.070 / 1.082 / 1.095 /
1.085 against 1.069 / 1.075 / 1.094 / 1.083 at batch 2 / 4 / 8 / 16), but it lets the gate/up
projection before it give its activation (linear.RowLinear.gives_activation): 1.0458 / 1.0109 ->
1.0333 / 0.9908 at batch 8 / 16, and in another call 1.0264 / 1.0340 / 1.0170 -> 1.0205 / 1.0239 /
0.9966 at 2 / 4 / 16 (three rounds). The 8B shape at batch 16, whose down projection went to cuBLAS
already, took 4.664 / 4.665 ms before and 4.761 / 4.606 after (two rounds): no clear change."""


FEW_ROWS_SPLIT = {"H200": (((33, 64), (2048, 2048), (64, 2048), (32, 128, 4, 5, 2)),
                          ((33, 64), (2048, 2048), (2049, 65536), (64, 128, 4, 4, 4)),
                          ((2, 16), (2048, 2048), (4097, 65536), (64, 128, 4, 4, 4)))}
"""By a part of the device's name: (((rows), (N), (K), (bn, bk, warps, stages, parts)), ...), each
range inclusive, the first that fits: products whose output the norm after it adds to the residual
stream (the o and down projections) and that do not hand it on themselves (HANDOFF_MOST_ROWS), split
along K in `parts` parts (split_config). At 64 rows the Llama-1B shape's o projection, whole, reads
its 8 MB in ~7 us (a quarter of its bound): each of its 64 programs reads all 64 rows of x for its
32 outputs, twice the weight's bytes through the L2 in all, and half the SMs have none; in two parts
twice the programs read half as much each, and the norm kernel adds the fp32 parts
(elementwise._norm_triton). On an H200, each product and the norm kernel after it over 16 layers'
weights in a CUDA graph, us a layer at 48 / 64 rows (the route before in brackets: few_rows whole,
or cuBLAS past FEW_ROWS_DEEPEST): 1B o 6.81 / 7.18 (8.16 / 8.34), down 14.49 / 14.81 (15.06 /
15.09). Through the engine (in-process engines alternated, four rounds of three runs, ms a step):
batch 48 / 64 1.179 / 1.227 -> 1.107 / 1.158, batch 16 (not split then) 1.009 either way. At 2-16
rows the 1B down projection, which hands nothing on (deeper than FEW_ROWS_DEEPEST), went whole
through cuBLAS at 13.9 us a layer for 7.9 us of bytes (16 rows, bench/gpu_parts.py); in 4 parts of
64 outputs, engines alternated (three rounds), batch 2 / 8 / 16 0.9994 / 1.0335 / 1.0175 -> 0.9741 /
0.9902 / 0.9879 ms, device floors at 256 tokens 0.983 / 1.000 / 0.997 -> 0.962 / 0.979 / 0.972; 32 x
128 tiles 1.081 / 1.102 / 1.077, 8 parts 1.005 / 1.020 / 1.024. At 17-32 rows (the graphs' 32 rows)
it is not split: batch 24 / 32 1.083 / 1.109 -> 1.098 / 1.135 in 64 x 128 tiles; in 32 x 128, 1.085
/ 1.108, within the runs' spread (floors 0.5% faster). The 8B shape's o and down (N 4,096) were
faster alone too (o 13.65 / 13.89 against 15.18 / 14.44, down 34.73 / 35.49 against 35.96 / 37.60,
in 64 x 128 tiles, two parts), not through the engine (ms a step at batch 48 / 64, whole 5.109 /
5.231, split 5.080 / 5.219, within its runs' spread), and its down projection at 2-16 rows was
slower split (4 parts of 64: batch 2 / 16 4.429 / 4.650 -> 4.490 / 4.766, floors 4.392 / 4.594 ->
4.458 / 4.707): not split. Nor is SmolLM2's down projection (N 576, K 1,536), whose engine's steps
at batch 48 / 64 are the host's: split, they spread 0.85-1.27 / 0.88-1.33 ms against 0.89-1.23 /
0.92-1.10 (medians 0.944 / 1.024 against 0.911 / 0.928; four rounds of three runs)."""


FEW_ROWS_K = 64
"""K must be a multiple of this: a config's K tile (bk) is halved until it divides K, down to it.
SmolLM2's products of K 576 (its hidden size) take 64; before, few_rows took only K of 256s, and
at 2-64 rows those products went to cuBLAS, each with a norm kernel before it and the gate/up's
SiLU kernel after: 239 kernels a step at batch 16 on an H200 against 153 at one row (gemv). Its
engines alternated in one process (three rounds, ms a step): batch 4 / 16 / 64 0.8719 / 0.8928 /
0.9450 -> 0.7623 / 0.8198 / 0.9310."""


def few_rows_config(device: torch.device, n: int, k: int, m: int) -> tuple[int, int, int, int] | None:
    """few_rows' config for m rows of an (n, k) product on this device; None: torch's linear."""
    config = _table_config(device, n, k, m)
    bk = _k_tile(config[1], k) if config is not None else None
    return None if bk is None else (config[0], bk, *config[2:])


def split_config(device: torch.device, n: int, k: int, m: int) -> tuple[int, int, int, int, int] | None:
    """(bn, bk, warps, stages, parts) for m rows of an (n, k) product whose parts the norm after it
    adds (FEW_ROWS_SPLIT); None: not split."""
    config = next((config for rows, ns, ks, config in for_device(FEW_ROWS_SPLIT, device) or ()
                   if rows[0] <= m <= min(rows[1], FEW_ROWS_LIMIT) and ns[0] <= n <= ns[1] and ks[0] <= k <= ks[1]),
                  None)
    bk = _k_tile(config[1], k, config[4]) if config is not None else None
    return None if bk is None else (config[0], bk, *config[2:])


def _k_tile(bk: int, k: int, parts: int = 1) -> int | None:
    """A config's K tile halved, down to FEW_ROWS_K, until `parts` of them divide K; None if none do."""
    while bk > FEW_ROWS_K and k % (parts * bk):
        bk //= 2
    return bk if k % (parts * bk) == 0 else None


def _table_config(device: torch.device, n: int, k: int, m: int) -> tuple[int, int, int, int] | None:
    if k > (for_device(FEW_ROWS_DEEPEST, device) or k):
        return None
    if m > FEW_ROWS_MOST:
        deepest, steps = for_device(FEW_ROWS_MANY, device) or (0, ())
        step = next(((narrow, wide) for most, narrow, wide in steps if m <= most), None)
        return None if step is None or k > deepest or n >= 65536 else step[n >= 8192]
    narrow = for_device(FEW_ROWS_NARROW, device)
    if narrow is not None and n <= narrow[0] and m <= narrow[1]:
        return narrow[2]
    return FEW_ROWS_WIDE if 8192 <= n < 65536 else FEW_ROWS



def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bn: int, bk: int, warps: int,
             stages: int, gated: bool = False, residual: torch.Tensor | None = None,
             next_norm: torch.Tensor | None = None, normed: tuple[torch.Tensor, float] | None = None,
             parts: int = 1):
    """x (M, K), M <= FEW_ROWS_LIMIT, @ weight (N, K).T (+ bias), bf16 or fp16, K a multiple of bk: each program
    streams bn rows of W once for every row of x. gated: as gemv's, (M, N / 2) out.
    residual (M, N): returns (total, squares, weighted): total = the product + residual, rounded as
    the norm kernel's add rounds it; squares (programs, M) fp32, each program's sum of its columns of
    total squared; weighted = total * next_norm (N,), rounded (None without next_norm).
    normed (squares, eps): x is such a `weighted` and squares its total's; the product is then
    rms_norm(total) * next_norm's, each row's 1 / rms applied to its sums (HANDOFF_MOST_ROWS says why).
    parts > 1 (none of the above; K a multiple of parts * bk): (parts, M, N) fp32, the products of
    K's parts, the bias in the first (FEW_ROWS_SPLIT)."""
    m = x.shape[0]
    n, k = weight.shape
    assert not (gated and residual is not None) and (residual is None or residual.stride() == (n, 1))
    assert parts == 1 or (not gated and residual is None and normed is None and k % (parts * bk) == 0)
    out = (torch.empty(m, n // 2 if gated else n, dtype=x.dtype, device=x.device) if parts == 1
           else torch.empty(parts, m, n, dtype=torch.float32, device=x.device))
    programs = triton.cdiv(n, bn)
    squares = torch.empty(programs, m, dtype=torch.float32, device=x.device) if residual is not None else out
    weighted = torch.empty_like(out) if next_norm is not None else out
    norm_squares, eps = normed or (out, 0.0)
    early = pdl.supported(x.device)
    _few_rows_kernel[(programs, parts)](
        x, weight, bias if bias is not None else weight, out, m, n, k, k // parts, x.stride(0), weight.stride(0),
        residual if residual is not None else x, squares, next_norm if next_norm is not None else x, weighted,
        norm_squares, eps, norm_squares.shape[0], HAS_BIAS=bias is not None, BM=max(16, triton.next_power_of_2(m)),
        BN=bn, BK=bk, SPLIT=parts > 1, GATED=gated, ADD=residual is not None, WEIGHTED=next_norm is not None,
        NORM=normed is not None,
        PARTS=triton.next_power_of_2(norm_squares.shape[0]) if normed is not None else 1, PDL=early,
        num_warps=warps, num_stages=stages, launch_pdl=early)
    if residual is not None:
        return out, squares, weighted if next_norm is not None else None
    return out


if triton is not None:
    from worker.engines.native.gemv import output_rows, silu_of_pairs

    @triton.jit
    def _few_rows_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, k_part, stride_x, stride_w, residual_ptr,
                         squares_ptr, next_norm_ptr, weighted_ptr, norm_squares_ptr, eps, parts, HAS_BIAS: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, GATED: tl.constexpr,
                         ADD: tl.constexpr, WEIGHTED: tl.constexpr, NORM: tl.constexpr, PARTS: tl.constexpr,
                         PDL: tl.constexpr):
        cols, valid = output_rows(BN, N, GATED)
        rows = tl.arange(0, BM)
        first = tl.program_id(1) * k_part  # 0 but for SPLIT's parts of K
        ks = first + tl.arange(0, BK)
        w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=valid[:, None], other=0.0,
                    eviction_policy="evict_first")
        pdl.wait_for_previous(PDL)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows < M)[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w))
        for start in range(first + BK, first + k_part, BK):
            ks = start + tl.arange(0, BK)
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=valid[:, None], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows < M)[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        if NORM:  # each row's 1 / rms from the parts of its sum of squares, added in their order
            part = tl.arange(0, PARTS)
            sums = tl.load(norm_squares_ptr + part[:, None] * M + rows[None, :],
                           mask=(part < parts)[:, None] & (rows < M)[None, :], other=0.0)
            acc = acc * tl.rsqrt(tl.sum(sums, 0) / K + eps)[:, None]
        if HAS_BIAS:  # (by the first part of a SPLIT product)
            bias = tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
            acc += tl.where(tl.program_id(1) == 0, bias, 0.0)[None, :]
        mask = (rows < M)[:, None] & valid[None, :]
        if SPLIT:
            tl.store(out_ptr + (tl.program_id(1) * M + rows[:, None]) * N + cols[None, :], acc, mask=mask)
        elif GATED:
            cols = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)
            tl.store(out_ptr + rows[:, None] * (N // 2) + cols[None, :], silu_of_pairs(acc, out_ptr.dtype.element_ty),
                     mask=(rows < M)[:, None] & (cols < N // 2)[None, :])
        elif ADD:  # as _norm_kernel adds: the product rounded, plus the residual, rounded
            total = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            total += tl.load(residual_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            total = total.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], total, mask=mask)
            total = tl.where(mask, total.to(tl.float32), 0.0)
            tl.store(squares_ptr + tl.program_id(0) * M + rows, tl.sum(total * total, 1), mask=rows < M)
            if WEIGHTED:
                weights = tl.load(next_norm_ptr + cols, mask=valid, other=0.0).to(tl.float32)
                tl.store(weighted_ptr + rows[:, None] * N + cols[None, :],
                         (total * weights[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

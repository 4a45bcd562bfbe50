"""Decode attention over the paged cache on CUDA, in one Triton kernel: one new token per sequence,
every sequence at once, inside the decode step's CUDA graphs too.

One program takes a sequence and a KV head (all the query heads of that KV head together) and walks
its block table with an online softmax. Where few programs run, each context is split in parts
(flash-decoding), and the last part to finish combines them: more parts for steps with a context
past LONG_CONTEXT, whose graphs are captured apart (graphs.py). With each row a sequence of its own,
the kernel can take the rotary embedding and cache write too (attention.rope_store_and_decode).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.engines.native import pdl

try:
    import triton
    import triton.language as tl

    from worker.engines.native.rotary import rotate_half
except ImportError:  # CPU installs have no Triton: attention.py's torch paths serve them
    triton = None

DECODE_STAGES = 2
"""The decode kernel's software pipeline: 3 stages, and 256-token tiles with them, were slower in the
engine's graphs with PDL (H100, 1B batch 1 / 16; docs/benchmarks.md)."""
SPLIT_PROGRAMS = 256
"""A decode launch of fewer (sequence, KV head) programs than this splits each context in about
SPLIT_PROGRAMS / (batch x KV heads) parts (a power of two): few sequences, read by enough programs."""
LONG_CONTEXT = 2048
"""A decode step whose longest context is past this many tokens splits contexts more: in up to
MAX_SPLITS parts, where there are fewer than SPLIT_PROGRAMS programs; a shorter one in up to
SHORT_SPLITS, where there are fewer than SHORT_PROGRAMS. A launch's parts that a context leaves
without tiles still start and wait, which costs short contexts what long ones gain from more parts,
so the CUDA graphs hold both launches where they differ (graphs.py; figures in docs/benchmarks.md)."""
MAX_SPLITS = 64
SHORT_SPLITS = 8
LONG_ROWS = 4
LONG_SPLITS = 32
"""A step of many sequences with a context past LONG_CONTEXT (a launch that splits no context:
split_parts) splits up to LONG_ROWS of its longest contexts all the same (_long_lens says which), in
up to LONG_SPLITS parts, in programs placed before the others'; every other context is walked whole.
Unsplit, one long context held the whole launch: one program walks a context's 64-token tiles at
about a microsecond each. On an H200, the kernel alone, 4 layers in a CUDA graph, every context at
256 tokens but one at 32,768, us a layer, Llama-1B's heads / the 8B's: batch 64 500.2 -> 40.9 /
990.7 -> 71.2 (the bytes: 23.3 / 46.6), batch 256 877.3 -> 63.5 / 1,033.3 -> 103.6 (46.7 / 93.4). 8
rows or 64 parts were no faster (batch 256, one 32k context: 69.1 with both); every row split in 16
parts made the short rows' idle parts start and wait too (24.4 against 12.9 us with none long)."""
LEAVE_EARLY = ((128, 64),)
"""(head_dim, tile) of long launches whose programs with nothing to walk (the parts no long row
takes, the rows its parts walk) leave before the PDL wait; at least one program of every launch
still waits, so none ends before the kernel ahead. H200, engine device floors, ms a step, two
rounds: 8B, 64-token tiles (from 64 rows), batch 256 with two 16k among 2,500-token contexts 27.666
-> 25.847, 128 with two 16k among 1k 10.146 -> 9.845, 64 with one 32k among 256 6.825 -> 6.665;
elsewhere they stay: 8B 128-token tiles (32 rows) 8.700 -> 8.863, 1B 64-token tiles 6.976 -> 7.566
(batch 256, two 16k; registers 80 -> 96), 128-token tiles 0.98-1.02x (docs/benchmarks.md)."""
REGISTER_CAPS = {(9, 0): ((64, 64, 64),)}
"""Per compute capability, (head_dim, tile, registers a thread) of unsplit launches compiled under
that cap: 64 registers, not 78, place 8 programs a SM, not 6, none spilled, so Llama-1B's 112-128 and
208-256 rows take a wave of programs fewer. H200, engine device floors at 256-token contexts, ms a
step: batch 112 / 128 / 256 1.480 / 1.520 / 2.132 -> 1.412 / 1.466 / 2.094; 96, 192, 224 within 1%.
Heads of 128 gained nothing at 72-88 (docs/benchmarks.md)."""
SHORT_PROGRAMS = 128
PART_TILES = 1
"""Each part of a split context walks at least this many tiles, and about sqrt(tiles x PART_SCALE):
more parts walk fewer tiles each and leave more to combine (figures in docs/benchmarks.md)."""
PART_SCALE = 0.25
WHOLE_TILES = 2
"""Contexts of at most this many tiles are never split; past it, where few programs run (batch 1-15
of 8 KV heads), parts and their combine beat walking 3-6 tiles in turn: H200, 1B batch 1 / 8 0.797 /
1.038 -> 0.780 / 1.005 ms a step, 8B within 0.7% (6 and PART_TILES 2 before; docs/benchmarks.md)."""
COMBINE_PARTS = 8
"""Parts the last one to finish loads at a time to combine them (COMBINE_PARTS x group x head_dim registers)."""
WIDE_TILE_LANES = 1 << 15
"""An unsplit decode whose programs hold at most this many head-dim lanes in all (batch x KV heads
x head_dim) walks 128-token tiles, not 64: few programs a SM, each needs more bytes in flight
(figures in docs/benchmarks.md)."""


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrivals(device: torch.device) -> torch.Tensor:
    """Per (sequence, KV head) of a split decode, how many parts have finished; the last part
    combines them and sets it back to 0. Kept for the process, so the CUDA graphs that read it
    outlive no buffer of theirs; made by the eager warm-up run before any capture. Splits happen
    only while batch * kv_heads < SPLIT_PROGRAMS, or for LONG_ROWS rows (launch)."""
    if device not in _ARRIVALS:
        _ARRIVALS[device] = torch.zeros(SPLIT_PROGRAMS, dtype=torch.int32, device=device)
    return _ARRIVALS[device]


def split_parts(batch: int, kv_heads: int, long: bool) -> int:
    """Parts a decode launch of `batch` sequences may split each context in (its grid's third axis);
    `long`: its longest context is past LONG_CONTEXT tokens."""
    programs = batch * kv_heads
    most, below = (MAX_SPLITS, SPLIT_PROGRAMS) if long else (SHORT_SPLITS, SHORT_PROGRAMS)
    return min(most, triton.next_power_of_2(-(-SPLIT_PROGRAMS // programs))) if programs < below else 1


def launch(batch: int, kv_heads: int, long: bool) -> tuple[int, int]:
    """(parts a context may split in, long rows): split_parts' every-row split where few programs run;
    else, in a step with a context past LONG_CONTEXT, up to LONG_ROWS long contexts in up to
    LONG_SPLITS parts beside the others whole (_arrivals counts each long row's KV heads)."""
    splits = split_parts(batch, kv_heads, long)
    rows = min(LONG_ROWS, SPLIT_PROGRAMS // kv_heads) if long and splits == 1 else 0
    return (LONG_SPLITS, rows) if rows else (splits, 0)


def long_rows(lens, slots: int) -> int:
    """How many of a step's contexts (host ints) a launch with `slots` long rows splits: the
    kernel's rule (_long_lens) on the host, where the decode graphs choose which graph a step runs."""
    lens = np.asarray(lens)
    longest = int(lens.max(initial=0))
    for bar in (max(LONG_CONTEXT, longest // 4), max(LONG_CONTEXT, longest // 2)):
        if (count := int((lens > bar).sum())) <= slots:
            return count
    count = int(((lens == longest) & (lens > LONG_CONTEXT)).sum())
    return count if count <= slots else 0


def takes_long(lens, batch: int, kv_heads: int) -> bool:
    """Whether a step launching `batch` decode rows with these contexts (host ints) takes the long
    launch: some context past LONG_CONTEXT and, where that launch splits long rows, one to split
    (long_rows). A step with none runs as a short step's: with every context past 2,048 tokens and
    none split, the long launch was the slower, its whole rows holding the registers its long
    rows' code takes (the parts' and the scan's), fewer programs a SM (H200, batch 64 at 3,000
    tokens, 1B: 2.57 against 2.48 ms a step; 8B, its idle programs leaving early: 10.37 against
    10.33; docs/benchmarks.md). Without Triton, no launch."""
    lens = np.asarray(lens)
    if lens.max(initial=0) <= LONG_CONTEXT:
        return False
    slots = launch(batch, kv_heads, True)[1] if triton is not None else 0
    return not slots or long_rows(lens, slots) > 0


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 block_size: int, long: bool = False, rope: tuple | None = None) -> torch.Tensor:
    """attention.decode_attention on CUDA: q (B, H, D), tables (B, max_blocks) int32, lens (B,); `long`:
    some context is past LONG_CONTEXT tokens. rope: (k, v, cos, sin, slots) of the step's new tokens,
    each row its own sequence's (attention.rope_store_and_decode); q then unrotated."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))  # tl.dot's least rows
    kept = triton.next_power_of_2(group)  # the rows a part of a split context keeps for the combine
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    new_k, new_v, cos, sin, slots = rope or (q, q, q, q, lens)
    if rope is not None:
        assert new_k.stride(1) == new_v.stride(1) == dim and new_k.stride(0) == new_v.stride(0) and cos.stride(-1) == 1
    tile_blocks = max(1, 64 // block_size)
    # Few sequences make few programs, each walking its whole context: split every long context in
    # parts (flash-decoding), then combine them. Wide tiles where measured: the short launch's unsplit.
    splits, slots_long = launch(batch, kv_heads, long)
    if batch * kv_heads >= SHORT_PROGRAMS and batch * kv_heads * dim <= WIDE_TILE_LANES:
        tile_blocks *= 2
    partial = [torch.empty(slots_long or batch, kv_heads, splits, kept, *extra, device=q.device, dtype=torch.float32)
               for extra in ((), (), (dim,))] if splits > 1 else [out] * 3
    early = pdl.supported(q.device)
    # KV heads first: a sequence's heads run side by side, reading each token's K/V row (all its
    # heads) together. At batch 256 on an H100 that took 52.7 us a layer to 50.4 (256-token
    # contexts), 191.8 to 186.5 (1,024); batch 16, 6.6 to 6.4.
    # With long rows, the grid's second axis holds their parts first (placed first), then every row.
    grid = (kv_heads, slots_long * splits + batch, 1) if slots_long else (kv_heads, batch, splits)
    scan = max(256, triton.next_power_of_2(batch)) if slots_long else 1  # lengths a long row's scan reads: one compile
    _decode_kernel[grid](
        q, k_cache, v_cache, out, tables, lens, dim ** -0.5, PART_TILES, PART_SCALE, *partial,
        _arrivals(q.device) if splits > 1 else lens,
        new_k, new_v, cos, sin, slots, batch, LONG_CONTEXT, q.stride(0), q.stride(1), out.stride(0), k_cache.stride(0),
        k_cache.stride(1), tables.stride(0), new_k.stride(0), cos.stride(0),
        GROUP=group, GROUP_PAD=group_pad, KEPT=kept, HEAD_DIM=dim, BLOCK=block_size,
        TILE=block_size * tile_blocks, IEEE=q.dtype == torch.float32, SPLITS=splits, WHOLE_TILES=WHOLE_TILES,
        COMBINE=min(COMBINE_PARTS, splits), LONG_ROWS=slots_long, ROWS=scan,
        LEAVE=bool(slots_long) and (dim, block_size * tile_blocks) in LEAVE_EARLY,
        ROPE=rope is not None, PDL=early, num_warps=4, num_stages=DECODE_STAGES, launch_pdl=early,
        **_register_cap(q.device, dim, block_size * tile_blocks, splits == 1 and not slots_long))
    return out


def _register_cap(device: torch.device, dim: int, tile: int, unsplit: bool) -> dict:
    """The launch's maxnreg where REGISTER_CAPS holds one for this device, head size and tile."""
    caps = REGISTER_CAPS.get(torch.cuda.get_device_capability(device)) if unsplit and device.type == "cuda" else None
    return next(({"maxnreg": regs} for d, t, regs in caps or () if (d, t) == (dim, tile)), {})


if triton is not None:

    @triton.jit
    def _whole(first, second, ROWS: tl.constexpr, DIM: tl.constexpr):
        """rotate_half's two (ROWS, DIM / 2) halves side by side: (ROWS, DIM)."""
        return tl.reshape(tl.permute(tl.join(first, second), (0, 2, 1)), (ROWS, DIM))

    @triton.jit(do_not_specialize=["batch"])  # (read only by long rows' scans: no compile a batch size)
    def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale, part_tiles, part_scale, max_ptr,
                       total_ptr, acc_ptr, arrivals_ptr, new_k_ptr, new_v_ptr, cos_ptr, sin_ptr, slots_ptr, batch,
                       long_context, stride_qt, stride_qh, stride_ot, stride_ks, stride_kh, stride_table, stride_nt,
                       stride_cos, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, KEPT: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
                       SPLITS: tl.constexpr, WHOLE_TILES: tl.constexpr, COMBINE: tl.constexpr,
                       LONG_ROWS: tl.constexpr, ROWS: tl.constexpr, LEAVE: tl.constexpr, ROPE: tl.constexpr,
                       PDL: tl.constexpr):
        """One (sequence, KV head, part of the context). A context in more than one part: each part
        writes its running max, sum and unnormalized output, shapes (B, kv_heads, SPLITS, KEPT[, D]),
        and the last part to finish combines them: in one kernel, a context too short to split
        costs no second launch. LONG_ROWS: the grid's second axis is LONG_ROWS x SPLITS parts of
        the step's long contexts (long_row), then each of the `batch` rows whole, those taken by
        the parts doing nothing (LEAVE: leaving before the wait); the parts' shapes (LONG_ROWS,
        kv_heads, SPLITS, KEPT[, D]). ROPE: q is unrotated, and the new token's k (unrotated) and v
        are at new_k_ptr / new_v_ptr, row stride stride_nt, to be written at the row's slot."""
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        split = tl.program_id(2)
        holder = seq  # the row of the parts' buffers
        whole = seq >= 0  # (true) walks its row whole
        taken = seq < 0  # (false) walks nothing: a long row's parts walk it, or no long row is left for them
        if LONG_ROWS > 0:
            if seq < LONG_ROWS * SPLITS:
                holder = seq // SPLITS
                split = seq % SPLITS
                whole = seq < 0
                seq = long_row(lens_ptr, batch, holder, long_context, LONG_ROWS, ROWS)
                taken = seq < 0
                seq = tl.maximum(seq, 0)
            else:
                seq -= LONG_ROWS * SPLITS
                taken = is_long_row(lens_ptr, batch, seq, long_context, LONG_ROWS, ROWS)
        length = tl.load(lens_ptr + seq)
        num_tiles = tl.cdiv(length, TILE)
        if SPLITS == 1:
            parts = 1
            first_tile = 0
            last_tile = num_tiles
        else:
            # A short context (WHOLE_TILES) is not worth splitting: part 0 takes it whole. A longer one
            # in parts of at least part_tiles tiles and about sqrt(tiles x part_scale) (more parts walk
            # fewer tiles each, and make more to combine), up to SPLITS; the launch's others idle.
            least = tl.maximum(part_tiles, tl.ceil(tl.sqrt(num_tiles.to(tl.float32) * part_scale)).to(tl.int32))
            per_split = tl.maximum(tl.cdiv(num_tiles, SPLITS), least)
            parts = tl.where(num_tiles <= WHOLE_TILES, 1, tl.cdiv(num_tiles, per_split))
            first_tile = tl.where(split < parts, split * per_split, 0)
            last_tile = tl.where(split < parts,
                                 tl.where(parts == 1, num_tiles, tl.minimum(first_tile + per_split, num_tiles)), 0)
            if LONG_ROWS > 0:
                parts = tl.where(taken, 0, tl.where(whole, 1, parts))
                first_tile = tl.where(whole | taken, 0, first_tile)
                last_tile = tl.where(taken, 0, tl.where(whole, num_tiles, last_tile))
                if LEAVE and split >= parts:
                    return
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, TILE)
        # Before the wait: the lengths, the tables and the first tile's blocks are the step's inputs,
        # which no kernel of the layer writes (pdl.py); the K/V in them may be this step's. Not the
        # long launch's first blocks: held through its loop they took registers, fewer programs a SM
        # (H200, 1B, 128-token tiles, 114 registers against 149; docs/benchmarks.md).
        if LONG_ROWS == 0:
            first_blocks = tl.load(tables_ptr + seq * stride_table + (first_tile * TILE + t) // BLOCK,
                                   mask=first_tile * TILE + t < length, other=0)
        if ROPE:  # the step's angles and slots too
            half = tl.arange(0, HEAD_DIM // 2)
            angles = seq * stride_cos + half
            cos1 = tl.load(cos_ptr + angles).to(tl.float32)[None, :]
            cos2 = tl.load(cos_ptr + angles + HEAD_DIM // 2).to(tl.float32)[None, :]
            sin1 = tl.load(sin_ptr + angles).to(tl.float32)[None, :]
            sin2 = tl.load(sin_ptr + angles + HEAD_DIM // 2).to(tl.float32)[None, :]
            slot = tl.load(slots_ptr + seq).to(tl.int64)
        pdl.wait_for_previous(PDL)
        heads = kv_head * GROUP + g
        if ROPE:  # q and the new token's k rotated as rotary's kernel rotates them, rounded as it stores them
            q1, q2 = rotate_half(q_ptr + seq * stride_qt, cos1, sin1, cos2, sin2, heads * stride_qh, half,
                                  (g < GROUP)[:, None], HEAD_DIM // 2)
            q = _whole(q1, q2, GROUP_PAD, HEAD_DIM).to(q_ptr.dtype.element_ty)
            if (last_tile == num_tiles) & (last_tile > first_tile):  # the part that reads the new position writes it
                one = tl.zeros((1,), tl.int32)
                k1, k2 = rotate_half(new_k_ptr + seq * stride_nt + kv_head * HEAD_DIM, cos1, sin1, cos2, sin2, one,
                                      half, one[:, None] == 0, HEAD_DIM // 2)
                cached = slot * stride_ks + kv_head * stride_kh
                tl.store(k_ptr + cached + half[None, :], k1.to(k_ptr.dtype.element_ty))
                tl.store(k_ptr + cached + HEAD_DIM // 2 + half[None, :], k2.to(k_ptr.dtype.element_ty))
                tl.store(v_ptr + cached + d, tl.load(new_v_ptr + seq * stride_nt + kv_head * HEAD_DIM + d))
            tl.debug_barrier()  # the block's threads see those writes before they read its tiles
        else:
            q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None],
                        other=0.0)
        m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        for tile in range(first_tile, last_tile):
            position = tile * TILE + t
            valid = position < length
            if LONG_ROWS == 0:
                later = position >= (first_tile + 1) * TILE  # (tile > first_tile, as a mask Triton's interpreter takes)
                block = tl.load(tables_ptr + seq * stride_table + position // BLOCK, mask=valid & later, other=0)
                block = tl.where(tile > first_tile, block, first_blocks)
            else:
                block = tl.load(tables_ptr + seq * stride_table + position // BLOCK, mask=valid, other=0)
            offsets = (block * BLOCK + position % BLOCK).to(tl.int64)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if SPLITS == 1 or parts == 1:
            if split == 0:
                result = acc / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(out_ptr + seq * stride_ot + heads[:, None] * HEAD_DIM + d[None, :],
                         result.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])
        elif split < parts:
            part = ((holder * tl.num_programs(0) + kv_head) * SPLITS + split) * KEPT
            tl.store(max_ptr + part + g, m, mask=g < KEPT)
            tl.store(total_ptr + part + g, total, mask=g < KEPT)
            tl.store(acc_ptr + (part + g[:, None]) * HEAD_DIM + d[None, :], acc, mask=(g < KEPT)[:, None])
            arrival = arrivals_ptr + holder * tl.num_programs(0) + kv_head
            tl.debug_barrier()  # every thread's stores before the release of the arrival
            if tl.atomic_add(arrival, 1, sem="acq_rel") == parts - 1:  # the others' stores are visible now
                tl.debug_barrier()
                _combine(max_ptr, total_ptr, acc_ptr, out_ptr, holder, seq, kv_head, tl.num_programs(0), parts,
                         stride_ot, GROUP, KEPT, HEAD_DIM, SPLITS, COMBINE)
                tl.atomic_xchg(arrival, 0)

    @triton.jit
    def _long_lens(lens_ptr, batch, long_context, LONG_ROWS: tl.constexpr, ROWS: tl.constexpr):
        """Each row's index (ROWS,) and whether its context is long: past long_context tokens and
        past a quarter of the longest, or where that makes more than LONG_ROWS, past half of it, or
        else the longest: at most LONG_ROWS, or none (of many as long, splitting some gains nothing:
        one taken whole still walks its context alone). Cheaper than a sort for the LONG_ROWS
        longest (tl.sort), which measured no faster a step."""
        rows = tl.arange(0, ROWS)
        lens = tl.load(lens_ptr + rows, mask=rows < batch, other=0)
        longest = tl.max(lens, 0)
        long = lens > tl.maximum(long_context, longest // 4)
        if tl.sum(long.to(tl.int32), 0) > LONG_ROWS:
            long = lens > tl.maximum(long_context, longest // 2)
        if tl.sum(long.to(tl.int32), 0) > LONG_ROWS:
            long = (lens == longest) & (lens > long_context)
        return rows, long & (tl.sum(long.to(tl.int32), 0) <= LONG_ROWS)

    @triton.jit
    def long_row(lens_ptr, batch, slot, long_context, LONG_ROWS: tl.constexpr, ROWS: tl.constexpr):
        """The row of the step's slot-th long context in row order (_long_lens), -1 where there are fewer."""
        rows, long = _long_lens(lens_ptr, batch, long_context, LONG_ROWS, ROWS)
        rank = tl.cumsum(long.to(tl.int32), 0) - 1
        return tl.max(tl.where(long & (rank == slot), rows, -1), 0)

    @triton.jit
    def is_long_row(lens_ptr, batch, seq, long_context, LONG_ROWS: tl.constexpr, ROWS: tl.constexpr):
        """Whether row seq's context is long (long_row gives it a slot); the others' contexts are read
        only where its own is past long_context."""
        long_one = seq < 0
        if tl.load(lens_ptr + seq) > long_context:
            rows, long = _long_lens(lens_ptr, batch, long_context, LONG_ROWS, ROWS)
            long_one = tl.sum(tl.where(rows == seq, long.to(tl.int32), 0), 0) > 0
        return long_one

    @triton.jit
    def _combine(max_ptr, total_ptr, acc_ptr, out_ptr, holder, seq, kv_head, kv_heads, parts, stride_ot,
                 GROUP: tl.constexpr, KEPT: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                 COMBINE: tl.constexpr):
        """The `parts` parts of one (sequence, KV head), at row `holder` of the parts' buffers,
        rescaled to their common max and summed, COMBINE parts loaded at a time, past L1 (other SMs
        wrote them)."""
        g = tl.arange(0, KEPT)
        d = tl.arange(0, HEAD_DIM)
        m_all = tl.full((KEPT,), float("-inf"), tl.float32)
        total = tl.zeros((KEPT,), tl.float32)
        acc = tl.zeros((KEPT, HEAD_DIM), tl.float32)
        for first in range(0, parts, COMBINE):
            p = first + tl.arange(0, COMBINE)
            rows = ((holder * kv_heads + kv_head) * SPLITS + p)[:, None] * KEPT + g[None, :]  # (COMBINE, KEPT)
            here = (p < parts)[:, None]
            m = tl.load(max_ptr + rows, mask=here, other=float("-inf"), cache_modifier=".cg")
            m_new = tl.maximum(m_all, tl.max(m, 0))
            weight = tl.where(m > float("-inf"), tl.exp(m - m_new[None, :]), 0.0)  # a part not loaded has max -inf
            carried = tl.where(m_all > float("-inf"), tl.exp(m_all - m_new), 0.0)  # the sums so far, rescaled
            total = total * carried + tl.sum(
                tl.load(total_ptr + rows, mask=here, other=0.0, cache_modifier=".cg") * weight, 0)
            acc = acc * carried[:, None] + tl.sum(
                tl.load(acc_ptr + rows[:, :, None] * HEAD_DIM + d[None, None, :], mask=here[:, :, None], other=0.0,
                        cache_modifier=".cg") * weight[:, :, None], 0)
            m_all = m_new
        result = acc / tl.where(total > 0, total, 1.0)[:, None]
        heads = kv_head * GROUP + g
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * HEAD_DIM + d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])

"""Attention over the paged KV cache.

Caches are (slots, kv_heads, head_dim) per layer, slot = block * block_size + offset. Two paths:
- `prefill_attention`: each sequence's new tokens over its context with torch's SDPA: prompts
  with nothing cached yet among their own tokens (equal lengths batched), the others over their
  context gathered from the cache.
- `decode_attention`: one new token per sequence, every sequence at once; on CUDA a Triton kernel
  that walks the block table (one program per sequence and KV head, all the query heads of that KV
  head together, online softmax), which also runs inside a CUDA graph; elsewhere a batched gather.
  A step that mixes both runs each on its own rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton; the torch paths below serve them
    triton = None


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, fresh: list[torch.Tensor],
                      sequences: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """q (T, H, D), k and v (T, kv_heads, D) of the packed new tokens. `fresh`: (n, L) rows of T of
    sequences with nothing cached before this step, which attend causally among their own tokens,
    one SDPA call for each length. `sequences`: (offset in T, query_len, context slots, causal
    mask) of those with cached tokens before. Returns (T, H, D); other rows are left unset."""
    out = torch.empty_like(q)
    for rows in fresh:  # rows (n, L)
        qs, ks, vs = (x[rows].transpose(1, 2) for x in (q, k, v))  # (n, heads, L, D)
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(1, 2)
    for start, query_len, slots, mask in sequences:
        ks = k_cache.index_select(0, slots).transpose(0, 1)  # (kv_heads, C, D)
        vs = v_cache.index_select(0, slots).transpose(0, 1)
        qs = q[start:start + query_len].transpose(0, 1)  # (H, Q, D)
        out[start:start + query_len] = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, enable_gqa=True).transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """q (B, H, D), one token per sequence; tables (B, max_blocks) int32; lens (B,) context
    lengths, int32 or int64 (0 for a padding row, whose output is 0). Returns (B, H, D)."""
    if q.is_cuda and triton is not None:
        return _decode_triton(q, k_cache, v_cache, tables, lens, block_size)
    return _decode_gather(q, k_cache, v_cache, tables, lens, block_size)


def _decode_gather(q, k_cache, v_cache, tables, lens, block_size):
    batch, heads, dim = q.shape
    longest = int(lens.max()) if batch else 0
    if longest == 0:
        return torch.zeros_like(q)
    width = -(-longest // block_size)
    kv_heads = k_cache.shape[1]
    blocks = tables[:, :width].reshape(-1)
    # Whole blocks at a time (index_select of block_size contiguous rows): on CPU a gather slot by
    # slot took most of a decode step at batch 8. (B, kv_heads, width * block_size, D):
    k, v = (cache.view(-1, block_size, kv_heads, dim).index_select(0, blocks)
            .view(batch, width * block_size, kv_heads, dim).transpose(1, 2) for cache in (k_cache, v_cache))
    mask = (torch.arange(width * block_size, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    queries = q[:, :, None, :]
    if q.device.type == "cpu" and q.dtype != torch.float32:  # torch's CPU SDPA is 5x slower in bf16 than in fp32
        queries, k, v = queries.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, enable_gqa=True)[:, :, 0, :].to(q.dtype)
    return torch.where(lens[:, None, None] > 0, out, 0)


def _decode_triton(q, k_cache, v_cache, tables, lens, block_size):
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    tile_blocks = max(1, 64 // block_size)
    _decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, out, tables, lens, dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, BLOCK=block_size,
        TILE=block_size * tile_blocks, IEEE=q.dtype == torch.float32, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
                       stride_qt, stride_qh, stride_ks, stride_kh, stride_table,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        length = tl.load(lens_ptr + seq)
        num_tiles = tl.cdiv(length, TILE)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, TILE)
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=(g < GROUP)[:, None], other=0.0)
        m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        for tile in range(num_tiles):
            position = tile * TILE + t
            valid = position < length
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
        result = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])

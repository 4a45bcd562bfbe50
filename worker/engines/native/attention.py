"""Attention over the paged KV cache.

Caches are (slots, kv_heads, head_dim) per layer, slot = block * block_size + offset. Two paths:
- `prefill_attention`: each sequence's new tokens over its context with torch's SDPA: prompts
  with nothing cached yet among their own tokens (equal lengths batched), the others over their
  context gathered from the cache (on CPUs the cached part and the chunk's own part apart, merged;
  on CUDA all of them in one Triton kernel over the block tables, paged_prefill.py).
- `decode_attention`: one new token per sequence, every sequence at once; on CUDA a Triton kernel
  that walks the block tables (paged_decode.py), which also runs inside a CUDA graph; elsewhere a
  batched gather of blocks.
  On CPUs the C++ kernel of kernels.py once built, which reads the blocks in place. With each row
  a sequence of its own, the same kernel can take the rotary embedding and cache write too
  (`rope_store_and_decode`, rotating as rotary.py does).
  A step that mixes both runs each on its own rows.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from worker.engines.native import kernels
from worker.engines.native.paged_decode import paged_decode, triton
from worker.engines.native.paged_prefill import paged_prefill

SDPA_ON_CUDA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Not cuDNN's, which torch picks first on an H100: it builds a plan for every sequence length it
has not seen, ~40 ms each (a 200-token prompt's first token took 60 ms against 7 when its length
had come before); flash takes any length as it comes (0.05-0.13 ms, first length or not)."""
def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, fresh: list[tuple[int, int, int, torch.Tensor | None]],
                      sequences: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]],
                      paged: tuple | None = None, block_size: int = 0) -> torch.Tensor:
    """q (T, H, D), k and v (T, kv_heads, D) of the packed new tokens. `fresh`: (start, n, L, rows)
    of sequences with nothing cached before this step, which attend causally among their own tokens,
    one SDPA call for each length (rows None: they lie one after another, read and written as views;
    the gathers and the scatter were 8 of a 109 ms 32k-token prefill on an H100, Llama-1B shape).
    `sequences`: (offset in T, query_len, context slots, causal mask) of those with cached tokens
    before; `paged` (CUDA): the same as paged_prefill's meta, all of them in one kernel call.
    Returns (T, H, D); other rows are left unset."""
    with sdpa_kernel(SDPA_ON_CUDA) if q.device.type == "cuda" else contextlib.nullcontext():
        return _prefill_attention(q, k, v, k_cache, v_cache, fresh, sequences, paged, block_size)


def _prefill_attention(q, k, v, k_cache, v_cache, fresh, sequences, paged, block_size) -> torch.Tensor:
    out = torch.empty_like(q)
    for start, count, length, rows in fresh:
        span = slice(start, start + count * length)
        if rows is None:
            qs, ks, vs = (x[span].view(count, length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        else:
            qs, ks, vs = (x[rows].transpose(1, 2) for x in (q, k, v))  # (n, heads, L, D)
        attended = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(1, 2)
        if rows is None:
            out[span] = attended.reshape(count * length, *q.shape[1:])
        else:
            out[rows] = attended
    if paged is not None:
        paged_prefill(q, k_cache, v_cache, out, paged, block_size)
        return out
    for start, query_len, slots, mask in sequences:
        ks, vs = k_cache.index_select(0, slots), v_cache.index_select(0, slots)  # (C, kv_heads, D)
        if q.device.type == "cpu" and _CPU_FLASH is not None:
            out[start:start + query_len] = _after_cached_cpu(q[start:start + query_len], ks, vs)
            continue
        out[start:start + query_len] = F.scaled_dot_product_attention(
            q[start:start + query_len].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask,
            enable_gqa=True).transpose(0, 1)
    return out


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _after_cached_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A prefill chunk's attention on CPU: q (Q, H, D) over k, v (C, kv_heads, D) whose last Q rows
    are the chunk's own tokens. Torch's CPU SDPA with the explicit causal mask this needs ran
    its math path (175 ms a layer for 512 queries over a 7,680-token context on 2 cores); here the
    cached part (no mask: each KV head's query heads as one longer query) and the chunk's own part
    (causal) run its flash kernel (51 ms), merged by their log-sum-exps in fp32."""
    queries, heads, dim = q.shape
    kv_heads = k.shape[1]
    group, cached = heads // kv_heads, k.shape[0] - queries
    grouped = q.view(queries, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * queries, dim)
    out_cached, lse_cached = _CPU_FLASH(grouped, k[:cached].transpose(0, 1)[None], v[:cached].transpose(0, 1)[None])[:2]
    out_cached = out_cached.reshape(heads, queries, dim)  # (kv_heads, group, Q) in order is (H, Q)
    own_k, own_v = (x[cached:].transpose(0, 1).repeat_interleave(group, 0)[None] for x in (k, v))  # (1, H, Q, D)
    out_own, lse_own = _CPU_FLASH(q.transpose(0, 1)[None], own_k, own_v, 0.0, True)[:2]
    lse_cached, lse_own = lse_cached.reshape(heads, queries, 1), lse_own.reshape(heads, queries, 1)
    top = torch.maximum(lse_cached, lse_own)
    w_cached, w_own = (lse_cached - top).exp(), (lse_own - top).exp()
    merged = (out_cached.float() * w_cached + out_own[0].float() * w_own) / (w_cached + w_own)
    return merged.to(q.dtype).transpose(0, 1)


def rope_store_and_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                          lens: torch.Tensor, block_size: int, long: bool = False) -> torch.Tensor:
    """rotary.rope_and_store then decode_attention in one Triton kernel (CUDA), for a step whose rows are
    each a different sequence's one new token: no row reads another's K/V, so the part of each
    (sequence, KV head) that reads the new token's position rotates and writes it first. q (B, H, D),
    k and v (B, kv_heads, D) as the qkv projection leaves them (views of its rows, unrotated); cos,
    sin (B, 1, D). graphs.rotates_inside says where it pays."""
    return paged_decode(q, k_cache, v_cache, tables, lens, block_size, long,
                        rope=(k, v, cos.reshape(len(q), -1), sin.reshape(len(q), -1), slots))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, block_size: int, gather: tuple[torch.Tensor, torch.Tensor] | None = None,
                     long: bool = False) -> torch.Tensor:
    """q (B, H, D), one token per sequence; tables (B, max_blocks) int32; lens (B,) context
    lengths, int32 or int64 (0 for a padding row, whose output is 0). Returns (B, H, D).
    `gather`: decode_gather(tables, lens, block_size), made once for a step's layers (no padding rows).
    `long`: some context is past paged_decode.LONG_CONTEXT tokens (on CUDA, split in more parts)."""
    if q.is_cuda and triton is not None:
        return paged_decode(q, k_cache, v_cache, tables, lens, block_size, long)
    if q.device.type == "cpu" and kernels.loaded():
        return kernels.paged_decode(q, k_cache, v_cache, tables, lens, block_size)
    if gather is not None:
        return _decode_gather(q, k_cache, v_cache, block_size, *gather)
    return gather_attention(q, k_cache, v_cache, tables, lens, block_size)


def gather_attention(q, k_cache, v_cache, tables, lens, block_size):
    """decode_attention without Triton, for rows of any length (0 too)."""
    if not len(lens) or int(lens.max()) == 0:
        return torch.zeros_like(q)
    out = _decode_gather(q, k_cache, v_cache, block_size, *decode_gather(tables, lens, block_size))
    return torch.where(lens[:, None, None] > 0, out, 0)


def decode_gather(tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks the gather path reads, (B * width,), and which of their slots count, (B, 1, 1,
    width * block_size): the same for every layer of a step."""
    width = -(-int(lens.max()) // block_size)
    mask = torch.arange(width * block_size, device=lens.device)[None, :] < lens[:, None]
    return tables[:, :width].reshape(-1), mask[:, None, None, :]


def _decode_gather(q, k_cache, v_cache, block_size, blocks, mask):
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    # Whole blocks at a time (index_select of block_size contiguous rows): on CPU a gather slot by
    # slot took most of a decode step at batch 8. (B, kv_heads, width * block_size, D):
    k, v = (cache.view(-1, block_size, kv_heads, dim).index_select(0, blocks)
            .view(batch, mask.shape[-1], kv_heads, dim).transpose(1, 2) for cache in (k_cache, v_cache))
    queries = q[:, :, None, :]
    if q.device.type == "cpu" and q.dtype != torch.float32:  # torch's CPU SDPA is 5x slower in bf16 than in fp32
        queries, k, v = queries.float(), k.float(), v.float()
    return F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, enable_gqa=True)[:, :, 0, :].to(q.dtype)

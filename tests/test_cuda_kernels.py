"""The native engine's CUDA kernels (these tests skip without a CUDA GPU, but for the choice of
graphs): Triton's against the torch paths, PDL's waits inside a graph, and SDPA's backends for
prompts. The linear products' kernels: tests/test_cuda_linear.py."""

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton decode kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_matches_the_gather_path(dtype):
    from worker.engines.native.attention import gather_attention
    from worker.engines.native.paged_decode import paged_decode

    torch.manual_seed(0)
    block_size, blocks, kv_heads, dim, heads = 16, 128, 3, 64, 9  # SmolLM2's grouping: 3 query heads per KV head
    k = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.tensor([1, 16, 17, 0, 300, 700], dtype=torch.int32, device="cuda")  # 700: long enough to split
    tables = torch.stack([torch.randperm(blocks, device="cuda")[:48] for _ in range(6)]).to(torch.int32)
    q = torch.randn(6, heads, dim, device="cuda", dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    # 6 sequences split their contexts in parts (twice: the parts' counts reset); 48 do not, in
    # 128-token tiles (paged_decode.WIDE_TILE_LANES); 192, in 64-token tiles.
    for copies in (1, 1, 8, 32):
        q, tables, lens = (x.repeat(copies, *[1] * (x.dim() - 1)) for x in (q[:6], tables[:6], lens[:6]))
        expected = gather_attention(q, k, v, tables, lens, block_size)
        torch.testing.assert_close(paged_decode(q, k, v, tables, lens, block_size), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton decode kernel runs on CUDA")
def test_a_register_cap_compiles_the_unsplit_decode_launch_under_it_with_the_same_bits(monkeypatch):
    """paged_decode.REGISTER_CAPS: the unsplit launch of its (head_dim, tile) compiles under the cap
    and gives the uncapped launch's bits; a launch splitting its contexts stays uncapped."""
    from worker.engines.native import paged_decode as pd

    kernel, seen = pd._decode_kernel, []

    class Recorded:  # (SPLITS, maxnreg, the compiled kernel's registers) of each launch
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                compiled = kernel[grid](*args, **kwargs)
                seen.append((kwargs["SPLITS"], kwargs.get("maxnreg"), compiled.n_regs))
                return compiled
            return run

    monkeypatch.setattr(pd, "_decode_kernel", Recorded())
    torch.manual_seed(0)
    block_size, blocks, kv_heads, dim = 16, 4096, 8, 64  # Llama-1B's heads
    k = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for rows in (4, 128):  # 32 programs split their contexts; 1,024 walk them whole in 64-token tiles
        lens = torch.randint(1, 300, (rows,), dtype=torch.int32, device="cuda")
        tables = torch.randint(0, blocks, (rows, 19), dtype=torch.int32, device="cuda")
        q = torch.randn(rows, 4 * kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        outs = []
        for caps in ({}, {torch.cuda.get_device_capability(): ((dim, 64, 48),)}):
            monkeypatch.setattr(pd, "REGISTER_CAPS", caps)
            outs.append(pd.paged_decode(q, k, v, tables, lens, block_size))
        assert torch.equal(*outs)
    assert [launch[:2] for launch in seen] == [(8, None), (8, None), (1, None), (1, 48)]
    assert seen[3][2] <= 48 < seen[2][2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton decode kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_launch_for_long_contexts_matches_the_gather_path(dtype):
    """A step with a context past paged_decode.LONG_CONTEXT: 6 sequences split their contexts in up to
    16 parts, 5,000 tokens in 16 (combined 8 at a time: paged_decode.COMBINE_PARTS), 2,100 in 11, short
    ones whole, a padding row; 48 sequences in up to 2; twice, so every count of arrivals went back to 0."""
    from worker.engines.native import attention, paged_decode

    torch.manual_seed(1)
    block_size, blocks, kv_heads, dim, heads = 16, 1024, 3, 64, 9
    k = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.tensor([5000, 1, 2100, 0, 300, 4097], dtype=torch.int32, device="cuda")
    tables = torch.stack([torch.randperm(blocks, device="cuda")[:320] for _ in range(6)]).to(torch.int32)
    q = torch.randn(6, heads, dim, device="cuda", dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert paged_decode.split_parts(6, kv_heads, True) == 16 and paged_decode.split_parts(48, kv_heads, True) == 2
    for copies in (1, 1, 8):
        q, tables, lens = (x.repeat(copies, *[1] * (x.dim() - 1)) for x in (q[:6], tables[:6], lens[:6]))
        expected = attention.gather_attention(q, k, v, tables, lens, block_size)
        torch.testing.assert_close(paged_decode.paged_decode(q, k, v, tables, lens, block_size, long=True), expected,
                                   atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton decode kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_many_rows_splits_its_long_contexts_beside_the_others_whole(dtype):
    """64 rows with Llama's 8 KV heads and a context past LONG_CONTEXT: the launch splits the longest
    few (paged_decode.launch: LONG_ROWS in up to LONG_SPLITS parts) and walks the rest whole;
    every row as the gather path gives it, twice (the arrivals back to 0), and with the rotary
    embedding and cache write inside, the caches and output of the launch that splits none
    (tests/test_decode_long_rows.py checks which rows, under Triton's interpreter)."""
    from worker.engines.native import attention, paged_decode
    from worker.engines.native.elementwise import rotate
    from worker.engines.native.rotary import rope_and_store

    torch.manual_seed(2)
    block_size, width, kv_heads, heads, dim, rows = 16, 640, 8, 32, 64, 64
    assert paged_decode.launch(rows, kv_heads, True) == (paged_decode.LONG_SPLITS, paged_decode.LONG_ROWS)
    row_lens = torch.full((rows,), 256, device="cuda")
    row_lens[[3, 40]], row_lens[[7, 9, 50]], row_lens[[11, 12]] = 10000, 3000, 0  # 3,000: tied at the bar, whole
    tables = torch.randperm(rows * width, device="cuda").view(rows, width).to(torch.int32)
    k_cache = torch.randn(rows * width * block_size, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(rows, heads, dim, device="cuda", dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    expected = attention.gather_attention(q, k_cache, v_cache, tables, row_lens, block_size)
    for _ in range(2):
        got = attention.decode_attention(q, k_cache, v_cache, tables, row_lens, block_size, long=True)
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    positions = (row_lens - 1).clamp(min=0)
    slots = tables.gather(1, (positions // block_size)[:, None])[:, 0].long() * block_size + positions % block_size
    new = torch.randn(rows, 2 * kv_heads, dim, device="cuda", dtype=dtype)
    angles = torch.randn(rows, 1, dim // 2, device="cuda").repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    rotated, _ = rope_and_store(q, new[:, :kv_heads], new[:, kv_heads:], cos, sin, want_k, want_v, slots, rotate)
    want = attention.decode_attention(rotated, want_k, want_v, tables, row_lens, block_size)
    got = attention.rope_store_and_decode(q, new[:, :kv_heads], new[:, kv_heads:], cos, sin, k_cache, v_cache, slots,
                                          tables, row_lens, block_size, long=True)
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    live = row_lens > 0  # (a padding row writes nowhere; here its slot is another row's first)
    assert torch.equal(k_cache[slots[live]], want_k[slots[live]]) and torch.equal(v_cache[slots[live]], want_v[slots[live]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton paged prefill kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_paged_prefill_matches_the_sdpa_path(dtype):
    """Chunks after cached context (a hit on a shared prefix, a long prompt's later chunk), all in one
    kernel call, against torch's SDPA a sequence at a time over the gathered context."""
    from worker.engines.native.attention import prefill_attention
    from worker.engines.native.paged_prefill import paged_prefill_meta

    torch.manual_seed(0)
    block_size, blocks, kv_heads, dim, heads = 16, 256, 3, 64, 9
    k_cache = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    shapes = [(2, 17), (16, 144), (5, 21), (70, 600), (64, 64 + 64), (1 + 128, 1000)]  # (query_len, context_len)
    tables = [torch.randperm(blocks)[:-(-context // block_size)].tolist() for _, context in shapes]
    starts = [sum(q for q, _ in shapes[:i]) for i in range(len(shapes))]
    q = torch.randn(sum(q for q, _ in shapes), heads, dim, device="cuda", dtype=dtype)
    sequences = []
    for start, (query_len, context), table in zip(starts, shapes, tables):
        slots = (torch.tensor(table, device="cuda")[:, None] * block_size + torch.arange(block_size, device="cuda"))
        mask = (torch.arange(context, device="cuda")[None, :]
                <= (context - query_len + torch.arange(query_len, device="cuda"))[:, None])
        sequences.append((start, query_len, slots.reshape(-1)[:context], mask))
    expected = prefill_attention(q, None, None, k_cache, v_cache, [], sequences)
    meta = paged_prefill_meta(starts, [s[0] for s in shapes], [s[1] for s in shapes], tables, torch.device("cuda"))
    got = prefill_attention(q, None, None, k_cache, v_cache, [], sequences, meta, block_size)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's backends on CUDA")
def test_prompts_attend_without_cudnn_attention(monkeypatch):
    """cuDNN's attention builds a plan for every sequence length it has not seen (~40 ms on an
    H100, paid by the first prompt of each length): prompts attend with it off, and it is back
    on after, as it was."""
    from worker.engines.native import attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    sdpa, seen = attention.F.scaled_dot_product_attention, []
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or sdpa(*args, **kwargs))
    q = torch.randn(2 * 37, 9, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2 * 37, 3, 64, device="cuda", dtype=torch.bfloat16), torch.randn(2 * 37, 3, 64, device="cuda", dtype=torch.bfloat16)
    out = attention.prefill_attention(q, k, v, None, None, [(0, 2, 37, None)], [])
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled() == before
    expected = sdpa(*(x.view(2, 37, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2).reshape(q.shape), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton rope-and-store kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rope_and_store_matches_the_torch_path(dtype):
    from worker.engines.native.rotary import rope_and_store
    from worker.engines.native.elementwise import rotate

    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 5, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)  # strided views, as in the model
    q, k, v = (x.reshape(tokens, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    angles = torch.randn(tokens, 1, dim // 2, device="cuda").repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([7, 0, 31, 16, 3], device="cuda")
    k_cache, v_cache = (torch.zeros(32, kv_heads, dim, device="cuda", dtype=dtype) for _ in range(2))
    got_q, got_k = rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots, rotate)
    want_q, want_k = (rotate(x.float(), cos.float(), sin.float()).to(dtype) for x in (q, k))  # one rounding, as the kernel
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_q, want_q, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(got_k, want_k, atol=tolerance, rtol=tolerance)
    for cache, want in ((k_cache, want_k), (v_cache, v)):
        torch.testing.assert_close(cache, torch.zeros_like(cache).index_copy_(0, slots, want), atol=tolerance, rtol=tolerance)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton decode kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotating_and_writing_inside_the_decode_kernel_gives_the_two_kernels_bits(dtype):
    """rope_store_and_decode against rope_and_store then decode_attention: the same caches to the
    bit, and the same output (to the bit in fp32; in bf16 within rounding, the products of the
    rotated q, joined from its halves in registers, summing in another order), for contexts split in
    parts and not, a new token that opens a block, and padding rows (length 0), whose K/V the one
    kernel writes nowhere. Each row a sequence of its own, with blocks of its own, as in a step of
    decodes."""
    from worker.engines.native.attention import decode_attention, rope_store_and_decode
    from worker.engines.native.rotary import rope_and_store
    from worker.engines.native.elementwise import rotate

    torch.manual_seed(0)
    block_size, width, heads, kv_heads, dim = 16, 48, 32, 8, 64  # Llama-1B's heads
    lens = torch.tensor([1, 17, 256, 700, 0, 33], device="cuda")  # 700: split in parts; 33: opens a block
    for copies in (1, 1, 8, 32):  # 6 rows split their contexts (twice: the parts' counts reset); 48 and 192 do not
        rows = len(lens) * copies
        row_lens = lens.repeat(copies)
        tables = torch.randperm(rows * width, device="cuda").view(rows, width).to(torch.int32)
        scratch = rows * width * block_size
        k_cache = torch.randn(scratch + block_size, kv_heads, dim, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        positions = (row_lens - 1).clamp(min=0)
        slots = tables.gather(1, (positions // block_size)[:, None])[:, 0].long() * block_size + positions % block_size
        slots = torch.where(row_lens > 0, slots, scratch)
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)  # views, as in the model
        q, k, v = (x.reshape(rows, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
        angles = torch.randn(rows, 1, dim // 2, device="cuda").repeat(1, 1, 2)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        rotated, _ = rope_and_store(q, k, v, cos, sin, want_k, want_v, slots, rotate)
        want = decode_attention(rotated, want_k, want_v, tables, row_lens, block_size)
        got_k, got_v = k_cache.clone(), v_cache.clone()
        got = rope_store_and_decode(q, k, v, cos, sin, got_k, got_v, slots, tables, row_lens, block_size)
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert torch.equal(got_k[:scratch], want_k[:scratch]) and torch.equal(got_v[:scratch], want_v[:scratch])
        assert torch.equal(got_k[scratch:], k_cache[scratch:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton embedding kernel runs on CUDA")
def test_the_embedding_and_angles_kernel_matches_the_torch_path():
    from worker.engines.native.elementwise import _embed_triton, embed

    torch.manual_seed(0)
    weight = torch.randn(1000, 576, device="cuda", dtype=torch.bfloat16)  # SmolLM2's width: not a power of 2
    rotations = torch.randn(2, 4096, 64, device="cuda", dtype=torch.bfloat16)
    for tokens in (1, 16, 300):
        ids, positions = torch.randint(0, 1000, (tokens,), device="cuda"), torch.randint(0, 4096, (tokens,), device="cuda")
        for got, want in zip(_embed_triton(ids, positions, weight, rotations), embed(ids, positions, weight, rotations)):
            assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton norm and SiLU kernels run on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_norm_and_silu_match_the_torch_path(dtype):
    from worker.engines.native.elementwise import Elementwise

    torch.manual_seed(0)
    plain, fused = Elementwise(), Elementwise()
    fused.use_triton()
    x, residual = (torch.randn(5, 576, device="cuda", dtype=dtype) for _ in range(2))  # SmolLM2's width: masked lanes
    weight = torch.rand(576, device="cuda", dtype=dtype) + 0.5
    gate_up = torch.randn(5, 2 * 1536, device="cuda", dtype=dtype)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), plain.rms_norm(x, weight, 1e-5), **tolerance)
    for got, want in zip(fused.add_rms_norm(x, residual, weight, 1e-5), plain.add_rms_norm(x, residual, weight, 1e-5)):
        torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(fused.silu_and_mul(gate_up), plain.silu_and_mul(gate_up), **tolerance)


def test_graphs_rotate_inside_attention_where_that_was_measured_to_pay():
    """graphs.rotates_inside: heads of 64 from two rows on (the Llama-1B shape's at 256 rows too),
    heads of 128 (the Llama-8B shape's, 8 KV heads) up to 16 rows but not at 64 or 256, where the
    rope kernel then attention was the faster; one row never (it keeps the two kernels)."""
    from worker.engines.native.graphs import rotates_inside

    assert not rotates_inside(1, 8, 64) and not rotates_inside(1, 8, 128)
    assert rotates_inside(2, 8, 64) and rotates_inside(256, 8, 64) and rotates_inside(256, 3, 64)
    assert rotates_inside(2, 8, 128) and rotates_inside(16, 8, 128)
    assert not rotates_inside(64, 8, 128) and not rotates_inside(256, 8, 128)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability 9.0")
def test_kernels_launched_early_wait_for_their_inputs_in_a_graph(monkeypatch):
    """With PDL a kernel starts while the one before it runs; each must still read what that one
    wrote. A layer's chain at batch 1 (norm, matrix-vector, rotary and cache write, attention, and
    the gate/up projection with its SiLU),
    captured in a CUDA graph and replayed on a new input each time, gives what it gives launched
    without PDL: a read before the wait would see the previous replay's values."""
    from worker.engines.native import pdl
    from worker.engines.native.attention import decode_attention
    from worker.engines.native.rotary import rope_and_store
    from worker.engines.native.elementwise import Elementwise
    from worker.engines.native.gemv import gemv

    torch.manual_seed(0)
    ops = Elementwise()
    ops.use_triton()
    heads, kv_heads, dim, width, blocks = 8, 2, 64, 512, 4
    weights = [torch.randn(n, k, device="cuda") / k ** 0.5 for n, k in
               (((heads + 2 * kv_heads) * dim, width), (width, heads * dim), (2 * 1024, width), (width, 1024))]
    norm = torch.rand(width, device="cuda") + 0.5
    k_cache, v_cache = (torch.randn(blocks * 16, kv_heads, dim, device="cuda") for _ in range(2))
    tables = torch.arange(blocks, dtype=torch.int32, device="cuda")[None, :]
    lens = torch.tensor([blocks * 16], dtype=torch.int32, device="cuda")
    slots = torch.tensor([blocks * 16 - 1], device="cuda")
    cos, sin = torch.rand(1, 1, dim, device="cuda"), torch.rand(1, 1, dim, device="cuda")
    x_in = torch.empty(1, width, device="cuda")

    def layer():
        residual, h = ops.add_rms_norm(x_in, x_in, norm, 1e-5)
        q, k, v = gemv(h, weights[0], None).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q, _ = rope_and_store(q.view(1, heads, dim), k.view(1, kv_heads, dim), v.view(1, kv_heads, dim), cos, sin,
                              k_cache, v_cache, slots, ops.rotate)
        attended = decode_attention(q, k_cache, v_cache, tables, lens, 16, None)
        residual, h = ops.add_rms_norm(gemv(attended.view(1, -1), weights[1], None), residual, norm, 1e-5)
        return gemv(gemv(h, weights[2], None, gated=True), weights[3], None) + residual

    inputs = [torch.randn(1, width, device="cuda") for _ in range(20)]
    results = {}
    for early in (False, True):
        monkeypatch.setitem(pdl._SUPPORTED, torch.device("cuda", torch.cuda.current_device()), early)
        monkeypatch.setitem(pdl._SUPPORTED, torch.device("cuda"), early)
        x_in.copy_(inputs[0])
        layer()  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer()
        results[early] = []
        for value in inputs:
            x_in.copy_(value)
            graph.replay()
            results[early].append(out.clone())
    for late, early in zip(results[False], results[True]):
        assert torch.equal(late, early)

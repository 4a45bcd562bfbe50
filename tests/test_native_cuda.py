"""The native engine's CUDA path (these tests skip without a CUDA GPU): its Triton kernels against the
torch paths, and steps launched ahead of their predecessors' tokens."""

import asyncio

import pytest
import torch

from worker.config_loader import load_config
from worker.engines.native.engine import NativeEngine
from worker.request import GenerationRequest, SamplingParams


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton decode kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_matches_the_gather_path(dtype):
    from worker.engines.native.attention import _decode_triton, gather_attention

    torch.manual_seed(0)
    block_size, blocks, kv_heads, dim, heads = 16, 128, 3, 64, 9  # SmolLM2's grouping: 3 query heads per KV head
    k = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.tensor([1, 16, 17, 0, 300, 700], dtype=torch.int32, device="cuda")  # 700: long enough to split
    tables = torch.stack([torch.randperm(blocks, device="cuda")[:48] for _ in range(6)]).to(torch.int32)
    q = torch.randn(6, heads, dim, device="cuda", dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for copies in (1, 1, 8):  # 6 sequences split their contexts in parts (twice: the parts' counts reset); 48 do not
        q, tables, lens = (x.repeat(copies, *[1] * (x.dim() - 1)) for x in (q[:6], tables[:6], lens[:6]))
        expected = gather_attention(q, k, v, tables, lens, block_size)
        torch.testing.assert_close(_decode_triton(q, k, v, tables, lens, block_size), expected, atol=tolerance, rtol=tolerance)


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
    from worker.engines.native.attention import rope_and_store
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton matrix-vector kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_linear_matches_torch(dtype):
    from worker.engines.native.gemv import RowLinear

    torch.manual_seed(0)
    for n, k, bias in ((3072, 2048, False), (1001, 576, True), (4, 8192, False)):  # even and uneven tiles, a bias
        linear = torch.nn.Linear(k, n, bias=bias, device="cuda", dtype=dtype)
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(RowLinear(linear)(x), linear(x), **tolerance)
        for rows in (3, 16, 40):  # a few rows through few_rows (half precision, with PDL), more through torch
            torch.testing.assert_close(RowLinear(linear)(x.repeat(rows, 1)), linear(x.repeat(rows, 1)), **tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_down_projection_takes_the_activation_as_it_reads_it(dtype):
    """One row's SiLU-and-multiply inside the matrix-vector kernel gives the two kernels' result to
    the bit; more rows take the two kernels."""
    from worker.engines.native.elementwise import Elementwise
    from worker.engines.native.gemv import RowLinear, few_rows, gemv

    torch.manual_seed(0)
    ops = Elementwise()
    ops.use_triton()
    for n, k in ((2048, 8192), (576, 1536)):
        down = RowLinear(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype))
        gate_up = torch.randn(1, 2 * k, device="cuda", dtype=dtype) * 3
        assert torch.equal(down.after_silu_and_mul(gate_up, ops.silu_and_mul), down(ops.silu_and_mul(gate_up)))
        assert torch.equal(gemv(gate_up, down.linear.weight, None, gated=True),
                           gemv(ops.silu_and_mul(gate_up), down.linear.weight, None))
        many = gate_up.repeat(4, 1)  # two kernels: the activation once for all the rows
        assert torch.equal(down.after_silu_and_mul(many, ops.silu_and_mul), down(ops.silu_and_mul(many)))
    if dtype == torch.bfloat16:  # few_rows' own shapes: uneven N, a bias, every row count up to its tile
        linear = torch.nn.Linear(512, 1001, device="cuda", dtype=dtype)
        for rows in (2, 7, 16, 33):
            x = torch.randn(rows, 512, device="cuda", dtype=dtype)
            torch.testing.assert_close(few_rows(x, linear.weight, linear.bias, 32, 256, 4, 3), linear(x),
                                       atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability 9.0")
def test_kernels_launched_early_wait_for_their_inputs_in_a_graph(monkeypatch):
    """With PDL a kernel starts while the one before it runs; each must still read what that one
    wrote. A layer's chain at batch 1 (norm, matrix-vector, rotary and cache write, attention, SiLU),
    captured in a CUDA graph and replayed on a new input each time, gives what it gives launched
    without PDL: a read before the wait would see the previous replay's values."""
    from worker.engines.native import pdl
    from worker.engines.native.attention import decode_attention, rope_and_store
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
        return gemv(ops.silu_and_mul(gemv(h, weights[2], None)), weights[3], None) + residual

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


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    """A random 2-layer Llama saved as an HF folder, with a word-level tokenizer (t0 .. t511)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tiny_model("llama", bos_token_id=0, eos_token_id=1)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t1", unk_token="t0").save_pretrained(folder)
    return folder


@pytest.mark.skipif(not torch.cuda.is_available(), reason="steps are launched ahead on CUDA, through the graphs")
async def test_steps_launched_ahead_end_each_stream_at_its_token(tiny_llama, monkeypatch):
    """On CUDA a decode step is launched before the previous one's tokens reach the host. An end
    found a step late (length, stop id, abort) must still end the stream at the right token, and
    every block must come back."""
    launched = []
    launch_ahead = NativeEngine._launch_ahead
    monkeypatch.setattr(NativeEngine, "_launch_ahead", lambda self, step: launched.append(launch_ahead(self, step)) or launched[-1])
    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                  "engine.dtype": "float32", "engine.device": "cuda",
                                                  "engine.args.speculation": "requested"})
    engine = NativeEngine(config)
    await engine.load_model()
    prompt = list(range(2, 42))

    async def run(index: int, **sampling) -> list[int]:
        request = GenerationRequest(request_id=f"r{index}-{len(launched)}", prompt_token_ids=prompt[index:],
                                    sampling=SamplingParams(ignore_eos=True, **sampling))
        return [t async for out in engine.stream_predict(request) for t in out.token_ids]

    try:
        alone = await run(0, max_tokens=40)
        assert len(alone) == 40 and sum(step is not None for step in launched) > 30
        stop = alone[9]
        assert await run(0, max_tokens=40, stop_token_ids=[stop]) == alone[:alone.index(stop) + 1]
        outputs = await asyncio.gather(*(run(i, max_tokens=n) for i, n in enumerate((1, 2, 17, 33))))
        assert [len(tokens) for tokens in outputs] == [1, 2, 17, 33]
        stream = engine.stream_predict(GenerationRequest(request_id="gone", prompt_token_ids=prompt,
                                                         sampling=SamplingParams(max_tokens=500, ignore_eos=True)))
        received, aborted = 0, False
        async for out in stream:
            received += len(out.token_ids)
            if received >= 5 and not aborted:  # >=: a slow reader gets several tokens in one output
                engine.abort(stream)
                aborted = True
        assert 5 <= received < 500
        # The engine thread drops the sequence before it posts the "aborted" message that ended the loop.
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="steps are launched ahead on CUDA, through the graphs")
async def test_rows_that_need_their_token_on_the_host_are_sampled_after_it_is_read(tiny_llama, monkeypatch):
    """A grammar's mask, penalties and logprobs need a row's last token on the host. Launched ahead,
    such a step's forward pass is queued first and its sampling once that token is read: every
    request must get what it gets from an engine that never launches ahead."""
    import json
    import re

    from worker.request import Constraint

    launched = []
    launch_ahead = NativeEngine._launch_ahead
    monkeypatch.setattr(NativeEngine, "_launch_ahead", lambda self, step: launched.append(launch_ahead(self, step)) or launched[-1])
    prompt = list(range(2, 42))
    kinds = {"grammar": dict(constraint=Constraint("regex", "(t7|t9){3,40}")), "penalty": dict(repetition_penalty=1.5),
             "logprobs": dict(logprobs=3), "seeded": dict(temperature=1.0, seed=7), "plain": {}}

    async def run(overlap: str) -> dict:
        config = load_config(None, {"HOME": "/tmp"}, {
            "engine.name": "native", "engine.model": str(tiny_llama), "engine.dtype": "float32",
            "engine.device": "cuda", "engine.args": json.dumps({"overlap_output": overlap, "speculation": "requested"})})
        engine = NativeEngine(config)
        await engine.load_model()

        async def one(index: int, kind: str) -> tuple[list[int], list[float]]:
            extra = dict(kinds[kind])
            constraint, logprobs = extra.pop("constraint", None), extra.pop("logprobs", None)
            request = GenerationRequest(request_id=f"{kind}-{overlap}", prompt_token_ids=prompt[index:],
                                        sampling=SamplingParams(max_tokens=24, ignore_eos=constraint is None, **extra),
                                        constraint=constraint, logprobs=logprobs)
            engine.prepare(request)
            tokens, values = [], []
            async for out in engine.stream_predict(request):
                tokens += out.token_ids
                values += [entry.logprob for entry in out.logprobs or ()]
            return tokens, values

        try:
            replies = await asyncio.gather(*(one(i, kind) for i, kind in enumerate(kinds)))
            assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
            return dict(zip(kinds, replies))
        finally:
            await engine.unload_model()

    late = await run("true")
    assert sum(step is not None for step in launched) > 10  # steps holding every kind of row went ahead
    launched.clear()
    eager = await run("false")
    assert not any(launched)
    for kind in kinds:
        assert late[kind][0] == eager[kind][0], kind
        assert late[kind][1] == pytest.approx(eager[kind][1], abs=1e-4), kind
    text = "".join(f"t{token}" for token in late["grammar"][0] if token != 1)
    assert re.fullmatch("(t7|t9){3,40}", text), text
    assert len(late["logprobs"][1]) == 24


@pytest.mark.skipif(not torch.cuda.is_available(), reason="speculation's CUDA path: verify rows in the graphs")
@pytest.mark.parametrize("eager", [False, True])
async def test_speculation_gives_the_same_tokens_on_cuda(tiny_llama, eager):
    """Rows with proposals run as decodes through the CUDA graphs (or eagerly): greedy and seeded
    sampled tokens are those of speculation off, alone and batched, and every block comes back."""
    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                  "engine.dtype": "float32", "engine.device": "cuda",
                                                  "engine.args.speculation": "requested",
                                                  "engine.args.enforce_eager": str(eager).lower()})
    engine = NativeEngine(config)
    await engine.load_model()
    prompts = [list(range(2 + i, 42)) * 3 for i in range(4)]  # repeated: the random model copies it at times

    async def run(index: int, on: bool, **sampling) -> list[int]:
        request = GenerationRequest(request_id=f"s{index}-{on}", prompt_token_ids=prompts[index], speculative=on,
                                    sampling=SamplingParams(max_tokens=48, ignore_eos=True, **sampling))
        return [t async for out in engine.stream_predict(request) for t in out.token_ids]

    try:
        for sampling in ({}, {"temperature": 0.8, "top_k": 50, "seed": 5}):
            off = [await run(i, False, **sampling) for i in range(4)]
            assert [await run(i, True, **sampling) for i in range(4)] == off
            assert list(await asyncio.gather(*(run(i, True, **sampling) for i in range(4)))) == off
        assert engine.speculation_stats()[2] > 0, "proposals were accepted"
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graphs' rows")
async def test_short_prompts_admitted_beside_decodes_run_in_the_graphs(tiny_llama, monkeypatch):
    """A step that admits a short prompt (after a cached block, or fresh, or scored for prompt
    logprobs) beside running decodes runs in the graphs, a row per prompt token: every request
    gets the tokens and logprobs it gets from an engine that runs no graphs, and every block
    comes back."""
    from worker.engines.native.graphs import DecodeGraphs

    chunked = []
    rows = DecodeGraphs.rows
    monkeypatch.setattr(DecodeGraphs, "rows", lambda self, scheduled, size: chunked.append(
        [count for _, count in scheduled]) or rows(self, scheduled, size))
    shared = list(range(2, 34))  # two blocks of 16: a later prompt starting so finds them cached

    async def run(eager: bool) -> list:
        config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                      "engine.dtype": "float32", "engine.device": "cuda",
                                                      "engine.args.enforce_eager": str(eager).lower()})
        engine = NativeEngine(config)
        await engine.load_model()

        async def one(name: str, prompt: list[int], delay: float, **extra) -> tuple:
            await asyncio.sleep(delay)
            request = GenerationRequest(request_id=f"{name}-{eager}", prompt_token_ids=prompt, **extra,
                                        sampling=SamplingParams(max_tokens=30, ignore_eos=True))
            tokens, scored = [], None
            async for out in engine.stream_predict(request):
                tokens += out.token_ids
                scored = out.prompt_logprobs or scored
            return tokens, [entry.logprob for entry in scored or () if entry.logprob is not None]

        try:
            replies = await asyncio.gather(
                *(one(f"long{i}", shared + [40 + i] * 20, 0.0) for i in range(4)),
                one("cached", shared + [90, 91, 92, 93, 94], 0.05), one("fresh", [7, 8, 9, 10, 11, 12], 0.1),
                one("scored", [60, 61, 62, 63], 0.15, prompt_logprobs=1))
            assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
            return replies
        finally:
            await engine.unload_model()

    graphs = await run(False)
    assert any(max(counts) > 1 for counts in chunked), chunked  # a prompt chunk ran in the graphs
    chunked.clear()
    eager = await run(True)
    assert not chunked
    for mine, theirs in zip(graphs, eager):
        assert mine[0] == theirs[0]
        assert mine[1] == pytest.approx(theirs[1], abs=1e-4)
    assert len(graphs[-1][1]) == 3  # the scored prompt's logprobs: every token's but the first's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_projection_takes_the_norm_before_it_as_it_reads_its_row(dtype):
    """One row's residual add and RMS norm inside the next projection's kernel: the residual stream
    to the bit, the projection as the norm kernel and the projection give it (the sum of squares
    adds up in another order)."""
    from worker.engines.native.elementwise import Elementwise
    from worker.engines.native.gemv import RowLinear

    torch.manual_seed(0)
    ops = Elementwise()
    ops.use_triton()
    for n, k in ((3072, 2048), (1001, 576)):  # SmolLM2's width: a row that is not a power of two
        linear = RowLinear(torch.nn.Linear(k, n, bias=n == 1001, device="cuda", dtype=dtype))
        x, residual = (torch.randn(1, k, device="cuda", dtype=dtype) for _ in range(2))
        weight = torch.rand(k, device="cuda", dtype=dtype) + 0.5
        total, out = linear.after_add_rms_norm(x, residual, weight, 1e-5)
        want_total, h = ops.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(total, want_total)
        tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(out, linear(h), **tolerance)
        assert linear.after_add_rms_norm(x.repeat(2, 1), residual.repeat(2, 1), weight, 1e-5) is None  # rows: two kernels

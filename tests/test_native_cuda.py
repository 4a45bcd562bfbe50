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
        assert RowLinear(linear)(x.repeat(3, 1)).shape == (3, n)  # more rows: torch's linear


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

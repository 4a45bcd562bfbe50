"""The native engine against Hugging Face transformers on the embedded model (CPU, fp32): same greedy
tokens one by one and batched, same logits, and the same tokens when the KV cache is too small and
sequences are preempted and recomputed."""

import asyncio
import shutil

import pytest
import torch

from worker.config import load_config
from worker.engines.native import kernels
from worker.engines.native.engine import NativeEngine
from worker.engines.native.model import Batch, load_model
from worker.request import GenerationRequest, SamplingParams

SHARED = "You are a careful assistant. Answer in one short paragraph. Question: "
PROMPTS = [SHARED + q for q in (
    "What is the capital of France?", "Why is the sky blue?", "Name three prime numbers.",
    "What does a compiler do?", "How do bees make honey?", "What is 12 times 12?")] + [
    "Once upon a time", "The three laws of thermodynamics are"]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_reference(embedded_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model)
    model = AutoModelForCausalLM.from_pretrained(embedded_model, dtype=torch.float32).eval()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return model, prompts, [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]


@torch.inference_mode()
def hf_greedy(model, ids: list[int], count: int) -> list[int]:
    """HF's forward and KV cache, argmax each step, no logit processors (generate's min_new_tokens
    would mask EOS; ignore_eos means only "do not stop")."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(count):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def engine_for(embedded_model, **settings) -> NativeEngine:
    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(embedded_model),
                                                  "engine.dtype": "float32", **settings})
    return NativeEngine(config)


async def generate(engine: NativeEngine, prompts: list[list[int]], together: bool) -> list[list[int]]:
    async def one(index, ids):
        request = GenerationRequest(request_id=f"r{index}", prompt_token_ids=list(ids),
                                    sampling=SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        return [t async for out in engine.stream_predict(request) for t in out.token_ids]

    if together:
        return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))
    return [await one(i, ids) for i, ids in enumerate(prompts)]


def test_one_step_logits_match(hf_reference, embedded_model):
    hf, prompts, _ = hf_reference
    model = load_model(embedded_model, torch.float32, torch.device("cpu"))
    c, block_size = model.config, 16
    k = torch.zeros(c.num_layers, 8 * block_size, c.num_kv_heads, c.head_dim)
    v = torch.zeros_like(k)
    ids = prompts[0]
    batch = Batch(torch.tensor(ids), torch.arange(len(ids)), torch.arange(len(ids)), [len(ids)], [len(ids)],
                  [list(range(8))], torch.tensor([len(ids) - 1]), block_size)
    with torch.inference_mode():
        reference = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(model(batch, k, v)[0], reference, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "torch-paths"])
async def test_greedy_tokens_match_hf_one_by_one_and_batched(hf_reference, embedded_model, cpu_kernels, monkeypatch):
    _, prompts, expected = hf_reference
    if not cpu_kernels:  # the paths of a machine without a C++ compiler
        monkeypatch.setattr(kernels, "_loaded", False)
    engine = engine_for(embedded_model, **({} if cpu_kernels else {"engine.kernel_dir": ""}))
    await engine.load_model()
    assert kernels.loaded() == cpu_kernels or not shutil.which("c++")
    try:
        assert await generate(engine, prompts, together=False) == expected
        assert await generate(engine, prompts, together=True) == expected
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


async def test_preemption_recomputes_to_the_same_tokens(hf_reference, embedded_model):
    _, prompts, expected = hf_reference
    weights_gib = load_model(embedded_model, torch.float32, torch.device("cpu")).weight_bytes() / (1 << 30)
    # Room for about 300 tokens of KV: the 8 sequences need ~730, so some are preempted and recomputed.
    engine = engine_for(embedded_model, **{"resources.memory_limit_gib": str(weights_gib + 0.0135)})
    await engine.load_model()
    try:
        assert engine.kv_budget_tokens() < 400
        assert await generate(engine, prompts, together=True) == expected
        assert engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


async def test_prefix_cache_hits_give_the_same_tokens(hf_reference, embedded_model):
    """The one-by-one run fills the cache; the batched run then takes each prompt's full blocks
    from it and must still produce HF's tokens."""
    _, prompts, expected = hf_reference
    engine = engine_for(embedded_model)
    await engine.load_model()
    try:
        assert await generate(engine, prompts[:3], together=False) == expected[:3]
        before = engine.prefix_hit_tokens
        assert await generate(engine, prompts, together=True) == expected
        full_blocks = sum((len(ids) - 1) // engine.blocks.block_size for ids in prompts[:3])
        assert full_blocks > 0
        assert engine.prefix_hit_tokens - before >= full_blocks * engine.blocks.block_size
        assert engine.prefix_queried_tokens >= engine.prefix_hit_tokens
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


async def test_requests_share_a_system_prompt(embedded_model):
    """Different questions after one long system prompt: with the cache, later requests reuse the
    first one's blocks and generate what they generate without it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model)
    system = "You are a meticulous assistant for a library. Cite the shelf of every book you mention. " * 3
    prompts = [tokenizer(system + q)["input_ids"] for q in ("Where is Dune?", "Who wrote Emma?", "Is Ulysses long?")]
    results = {}
    for caching in (False, True):
        engine = engine_for(embedded_model, **{"engine.args": f"{{enable_prefix_caching: {str(caching).lower()}}}"})
        await engine.load_model()
        try:
            first = await generate(engine, prompts[:1], together=False)
            rest = await generate(engine, prompts[1:], together=True)
            results[caching] = first + rest
            shared_blocks = len(tokenizer(system)["input_ids"]) // engine.blocks.block_size
            hits = engine.prefix_hit_tokens
            assert hits >= (2 * shared_blocks * engine.blocks.block_size if caching else 0)
        finally:
            await engine.unload_model()
    assert results[True] == results[False]


def test_int4_linear_lands_on_a_q4_1_grid():
    """Weights on GGUF Q4_1's grid (per 32 inputs d * q + m, q 0..15 with both ends used, as its
    quantizer makes them) come back to within bf16's rounding of the scales, bias included."""
    from worker.engines.native.linear import Int4Linear

    torch.manual_seed(0)
    rows, inputs = 96, 128
    q = torch.randint(0, 16, (rows, inputs // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(rows, inputs // 32, 1).half().float() * 0.02 + 1e-3
    m = -8 * d + torch.randn(rows, inputs // 32, 1).half().float() * 1e-3
    linear = torch.nn.Linear(inputs, rows)
    linear.weight.data = (d * q + m).view(rows, inputs)
    quantized = Int4Linear(linear.to(torch.bfloat16))
    assert quantized.weight_bytes < rows * inputs  # under a byte a weight, scales included
    for tokens in (1, 5):
        x = torch.randn(tokens, inputs)
        expected = x @ linear.weight.float().T + linear.bias.float()
        torch.testing.assert_close(quantized(x.bfloat16()).float(), expected, atol=3e-2, rtol=3e-2)


async def test_int4_engine_answers_the_france_question(embedded_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    engine = engine_for(embedded_model, **{"engine.dtype": "auto", "engine.args": "{quantization: int4}"})
    await engine.load_model()
    try:
        full = load_model(embedded_model, torch.bfloat16, torch.device("cpu")).weight_bytes()
        assert engine.model.weight_bytes() < 0.6 * full  # layers in 4 bits; embedding and output in bf16
        request = GenerationRequest(request_id="q", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=20))
        tokens = [t async for out in engine.stream_predict(request) for t in out.token_ids]
        assert tokenizer.decode(tokens, skip_special_tokens=True).strip() == "The capital of France is Paris."
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


@pytest.mark.parametrize(("settings", "message"), [
    ({"engine.args": "{quantization: int8}"}, "none | int4"),
    ({"engine.args": "{quantization: int4}", "engine.dtype": "float32"}, "bfloat16 activations"),
])
def test_quantization_settings_are_checked(embedded_model, settings, message):
    from worker.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        engine_for(embedded_model, **settings)


def test_block_manager_shares_refcounts_and_evicts_least_recently_freed():
    from worker.engines.native.block_manager import BlockManager, BlockTable

    blocks = BlockManager(num_blocks=6, block_size=4)
    tokens = list(range(10))  # two full blocks and a partial one
    first = BlockTable()
    blocks.grow(first, len(tokens))
    blocks.commit(first, tokens, len(tokens))
    assert len(first.hashes) == 2

    second = BlockTable()
    assert blocks.match_prefix(second, tokens + [99]) == (8, 8)
    assert second.blocks == first.blocks[:2]
    assert blocks.num_free == 3  # shared blocks are held once
    # A different second block shares only the first.
    other = BlockTable()
    assert blocks.match_prefix(other, tokens[:4] + [7, 7, 7, 7, 1]) == (4, 8)

    for table in (first, second, other):
        blocks.release(table)
    assert blocks.num_free == 6
    # Freed but cached: a new lookup still finds them.
    again = BlockTable()
    assert blocks.match_prefix(again, tokens) == (8, 8)
    blocks.release(again)
    # Taking every free block evicts the cached ones; after that nothing matches.
    hog = BlockTable()
    blocks.grow(hog, 6 * 4)
    blocks.release(hog)
    assert blocks.match_prefix(BlockTable(), tokens) == (0, 8)


def test_block_manager_evicts_a_shared_prefix_last():
    from worker.engines.native.block_manager import BlockManager, BlockTable

    blocks = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    table = BlockTable()
    blocks.grow(table, len(tokens))
    blocks.commit(table, tokens, len(tokens))
    blocks.release(table)
    # Two new blocks take the least recently freed: the partial tail, then the last full block;
    # the head of the prefix stays cached.
    one = BlockTable()
    blocks.grow(one, 4)
    assert blocks.match_prefix(BlockTable(), tokens)[0] == 4
    blocks.release(one)


def test_block_manager_without_prefix_caching_shares_nothing():
    from worker.engines.native.block_manager import BlockManager, BlockTable

    blocks = BlockManager(num_blocks=4, block_size=2, prefix_caching=False)
    table = BlockTable()
    blocks.grow(table, 5)
    blocks.commit(table, [1, 2, 3, 4, 5], 5)
    assert blocks.match_prefix(BlockTable(), [1, 2, 3, 4, 5]) == (0, 0)


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
                                                  "engine.dtype": "float32", "engine.device": "cuda"})
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
            "engine.device": "cuda", "engine.args": json.dumps({"overlap_output": overlap})})
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

"""The native engine's decode graphs on CUDA (these tests skip without a CUDA GPU): which graph a
step runs, by its rows (distinct sequences whose attention rotates and writes their K/V, short
prompts beside decodes) and by its longest context, with the tokens of an engine without them.
Steps launched ahead and speculation's checks: tests/test_native_cuda.py."""

import asyncio

import pytest
import torch

from worker.config_loader import load_config
from worker.engines.native.engine import NativeEngine
from worker.request import GenerationRequest, SamplingParams


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode graphs run on CUDA")
async def test_steps_past_a_long_context_run_the_graphs_that_split_it_more(tiny_llama, monkeypatch):
    """Decode steps whose longest context is past paged_decode.LONG_CONTEXT run the graphs captured with
    the long launch of the attention kernel (graphs.DecodeGraphs.key): greedy and seeded tokens of a
    long prompt, alone and beside short ones, are those of the eager engine, the short ones' steps
    alone run short graphs, and every block comes back."""
    from worker.engines.native import graphs, paged_decode

    prompts = [[2 + (5 * j) % 500 for j in range(paged_decode.LONG_CONTEXT + 40)]] + [[3 + i, 4, 5] for i in range(3)]
    keys, key = [], graphs.DecodeGraphs.key

    def spy(self, n, width, distinct):
        keys.append(key(self, n, width, distinct))
        return keys[-1]

    monkeypatch.setattr(graphs.DecodeGraphs, "key", spy)

    async def tokens(eager: bool, sampling: dict) -> list[list[int]]:
        config = load_config(None, {"HOME": "/tmp"}, {
            "engine.name": "native", "engine.model": str(tiny_llama), "engine.dtype": "float32", "engine.device": "cuda",
            "engine.max_model_len": "4096", "engine.args.enforce_eager": str(eager).lower()})
        engine = NativeEngine(config)
        await engine.load_model()

        async def one(index: int) -> list[int]:
            request = GenerationRequest(request_id=f"l{index}", prompt_token_ids=prompts[index],
                                        sampling=SamplingParams(max_tokens=24, ignore_eos=True, **sampling))
            return [t async for out in engine.stream_predict(request) for t in out.token_ids]

        try:
            out = [await one(0), *await asyncio.gather(*(one(i) for i in range(4))),
                   *await asyncio.gather(*(one(i) for i in range(1, 4)))]
            assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
            return out
        finally:
            await engine.unload_model()

    for sampling in ({}, {"temperature": 0.8, "top_k": 50, "seed": 5}):
        keys.clear()
        assert await tokens(False, sampling) == await tokens(True, sampling)
        assert any(long for _, _, long in keys), "a step ran a long graph"
        assert any(not long for _, _, long in keys), "the short prompts' steps ran short ones"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the graphs of distinct rows run on CUDA")
async def test_steps_of_many_decodes_rotate_and_write_inside_attention_with_the_same_tokens(tiny_llama, monkeypatch):
    """Decode steps of graphs.DISTINCT_MIN_ROWS sequences and more run the graphs whose attention
    kernel rotates and writes each row's K/V itself: greedy and seeded tokens are those of an engine
    without such graphs, batched the same, and every block comes back."""
    from worker.engines.native import graphs

    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                  "engine.dtype": "float32", "engine.device": "cuda"})
    prompts = [[2 + (7 * i + 3 * j) % 500 for j in range(5 + i)] for i in range(20)]
    seen, run = [], graphs.DecodeGraphs.run

    def spy(self, n, width, input_ids=None, distinct=False):  # whether a step ran a graph of distinct rows
        seen.append(distinct and (next(s for s in self.sizes if s >= n), True, False) in self.graphs)
        return run(self, n, width, input_ids, distinct)

    async def tokens(engine: NativeEngine, **sampling) -> list[list[int]]:
        async def one(index: int) -> list[int]:
            request = GenerationRequest(request_id=f"d{index}", prompt_token_ids=prompts[index],
                                        sampling=SamplingParams(max_tokens=40, ignore_eos=True, **sampling))
            return [t async for out in engine.stream_predict(request) for t in out.token_ids]
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    monkeypatch.setattr(graphs.DecodeGraphs, "run", spy)
    results, ran = [], []
    for min_rows in (graphs.DISTINCT_MIN_ROWS, 1 << 30):
        monkeypatch.setattr(graphs, "DISTINCT_MIN_ROWS", min_rows)
        engine = NativeEngine(config)
        await engine.load_model()
        seen.clear()
        try:
            results.append([await tokens(engine), await tokens(engine, temperature=0.8, top_k=50, seed=3)])
            assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
        finally:
            await engine.unload_model()
        ran.append(sum(seen))
    assert ran[0] >= 40 and ran[1] == 0  # most of the two runs' ~80 decode steps, then none
    assert results[0] == results[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graphs' rows")
async def test_short_prompts_admitted_beside_decodes_run_in_the_graphs(tiny_llama, monkeypatch):
    """A step that admits a short prompt (after a cached block, or fresh, or scored for prompt
    logprobs) beside running decodes runs in the graphs, a row per prompt token, and unscored
    prompts join the decodes' step launched ahead: every request gets the tokens and logprobs it
    gets from an engine that runs no graphs, and every block comes back."""
    from worker.engines.native.graphs import DecodeGraphs

    chunked, joined = [], []  # prompt rows' counts, of steps scheduled on the host / launched ahead
    rows = DecodeGraphs.rows
    monkeypatch.setattr(DecodeGraphs, "rows", lambda self, scheduled, size, **ahead: (
        joined if ahead else chunked).append([count for _, count in scheduled]) or rows(self, scheduled, size, **ahead))
    shared = list(range(2, 34))  # two blocks of 16: a later prompt starting so finds them cached

    async def run(eager: bool) -> list:
        config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                      "engine.dtype": "float32", "engine.device": "cuda",
                                                      "engine.args.enforce_eager": str(eager).lower()})
        engine = NativeEngine(config)
        await engine.load_model()

        decoding, longs = asyncio.Event(), set()  # set once every long request has its first token

        async def one(name: str, prompt: list[int], **extra) -> tuple:
            if not name.startswith("long"):
                await decoding.wait()  # so its prompt joins a step of the long ones' decodes
            request = GenerationRequest(request_id=f"{name}-{eager}", prompt_token_ids=prompt, **extra,
                                        sampling=SamplingParams(max_tokens=30, ignore_eos=True))
            tokens, scored = [], None
            async for out in engine.stream_predict(request):
                tokens += out.token_ids
                scored = out.prompt_logprobs or scored
                if tokens and name.startswith("long"):
                    longs.add(name)
                    if len(longs) == 4:
                        decoding.set()
            return tokens, [entry.logprob for entry in scored or () if entry.logprob is not None]

        try:
            replies = await asyncio.gather(
                *(one(f"long{i}", shared + [40 + i] * 20) for i in range(4)),
                one("cached", shared + [90, 91, 92, 93, 94]), one("fresh", [7, 8, 9, 10, 11, 12]),
                one("scored", [60, 61, 62, 63], prompt_logprobs=1))
            assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
            return replies
        finally:
            await engine.unload_model()

    graphs = await run(False)
    assert any(counts[-1] == 4 for counts in chunked), chunked  # the scored prompt, scheduled on the host
    # The cached prompt's 5 new tokens and the fresh one's 6 joined steps launched ahead.
    assert sorted(count for counts in joined for count in counts) == [5, 6], joined
    chunked.clear()
    joined.clear()
    eager = await run(True)
    assert not chunked and not joined
    for mine, theirs in zip(graphs, eager):
        assert mine[0] == theirs[0]
        assert mine[1] == pytest.approx(theirs[1], abs=1e-4)
    assert len(graphs[-1][1]) == 3  # the scored prompt's logprobs: every token's but the first's



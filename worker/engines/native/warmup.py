"""The native engine's warm-up on CUDA: the kinds of step a server meets, run before it is ready.

Triton compiles a kernel variant at its first call with a new set of constants, dtypes and
alignments. Capturing the CUDA graphs compiles the decode steps' variants, and eager steps pass
the same kinds of argument (model.py, sequence.batch_of); the rest came with the first requests of
a fresh host, 0.25-0.55 s each (Llama-1B shape on an H100, Triton's cache empty): prompts after a
cached prefix (the paged prefill kernel, for up to 16 new tokens and for more), and the greedy
choice (sampler.argmax) over up to 16 rows and over more, of the model's logits and of float ones
(sampling, penalties); and on an H200, few_rows' LM head over 17-31 rows of a step of prompts
(SmolLM2's: its vocabulary takes the kernel's wide tiles, which no other product there does). A
first batch of prompts sharing a prefix took 1.77 s to its first tokens, against 51-67 ms after
this warm-up, which takes 1.6-2.5 s with Triton's cache empty, less once full.
Where the engine speculates it also runs requests that do, then forgets what its steps taught the
speculator (their times include the compiles): with what they taught, a fresh worker's first
requests that asked to speculate found their proposals too dear to make.
"""

from __future__ import annotations

import asyncio

from worker.engines.native.sequence import DecodeRows
from worker.request import GenerationRequest, SamplingParams


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 0}


def prompt(first: int, length: int, vocab: int) -> list[int]:
    return [(first + 7 * i) % vocab for i in range(length)]


async def warm_up(engine) -> None:
    """Runs, on `engine` (loaded, on CUDA), with every prompt chunk a prefill: a request decoding
    throughout; beside it a fresh prompt, one after its cached blocks with 8 new tokens, prompts of
    20 and 40 tokens, one with 40 new tokens beside 32 short prompts, 19 short prompts at once, a
    sampled one alone and one beside 32 more; where the engine speculates, requests that ask to,
    alone and two at once."""
    vocab, block = engine.info.vocab_size, engine.blocks.block_size
    room = min(engine.info.max_model_len - 64, engine.kv_budget_tokens() // 4) // block * block
    if room < 2 * block:
        return  # a context or cache this small: the kernels compile at first use
    shared = prompt(11, min(256, room), vocab)
    decoding = asyncio.Event()

    async def run(name: str, ids: list[int], max_tokens: int, speculative: bool | None = None, **sampling) -> None:
        request = GenerationRequest(request_id=f"warmup-{name}", prompt_token_ids=ids, speculative=speculative,
                                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
        async for _ in engine.stream_predict(request):
            decoding.set()

    async def beside() -> None:
        await decoding.wait()
        await run("fresh", shared, 1)
        await run("cached-8", shared + prompt(13, 8, vocab), 1)  # alone: a step's longest query picks the variant
        for length in (20, 40):  # 17-63 rows: few_rows' tiles of 32 and 64 rows, gated and handing off
            await run(f"rows-{length}", prompt(29 + length, length, vocab), 1)
        await asyncio.gather(run("cached-40", shared + prompt(17, 40, vocab), 1), *shorts("greedy"))
        # 17-31 rows of logits at once, few_rows' tile of 32 rows, which no graph has (they take 2,
        # 4, 8, 16, 32, 48, 64 rows; 33-47 come beside the 32 shorts above): without it a first burst
        # of 64 prompts compiled the LM head's on an H200 (SmolLM2, 0.35 s; test_native_warm_up.py
        # checks the rows here, test_native_cuda.py a burst past the graphs in service).
        await asyncio.gather(*shorts("burst", 19))
        await run("sampled", prompt(19, 4, vocab), 2, **SAMPLED)  # sampling chooses over float logits
        await asyncio.gather(run("sampled-many", prompt(23, 4, vocab), 2, **SAMPLED), *shorts("beside-sampled"))
        if engine.speculates:  # checks of proposals, greedy and sampled, alone and side by side
            copied = prompt(37, 24, vocab) * 3  # a model copies it at times, and proposals come of that
            await run("speculative", copied, 32, speculative=True)
            await asyncio.gather(run("speculative-beside", copied, 32, speculative=True),
                                 run("speculative-sampled", copied, 32, speculative=True, **SAMPLED))

    def shorts(name: str, count: int = 32) -> list:
        """More than 16 rows choose their tokens in one step: the greedy choice takes another variant."""
        return [run(f"{name}-{i}", prompt(100 + i, 4, vocab), 2) for i in range(count)]

    # Every prompt chunk a prefill, none as graph rows (whose kernels the graphs' capture compiled).
    graph_rows, engine.decode_rows = engine.decode_rows, DecodeRows()
    try:
        await asyncio.gather(run("decoding", prompt(3, 4, vocab), 64), beside())
    finally:
        engine.decode_rows = graph_rows
    forget_warm_up(engine)


def forget_warm_up(engine) -> None:
    """What the warm-up's requests (the worker's among them) counted, and what their steps' times
    (compiles among them) taught the speculator, is not the service's."""
    engine.batcher.prefix_queried_tokens = engine.batcher.prefix_hit_tokens = 0
    engine.speculator.forget()

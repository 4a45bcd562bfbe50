"""The CUDA decode graphs' host inputs (graphs.HostInputs), which run on the CPU: a step launched
ahead of the same rows advances the last step's inputs instead of rewriting them, and must write
what a full pass writes. And, on CUDA, how they reach the graphs (graphs.FEED_BYTES)."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from worker.config_loader import load_config
from worker.engines.native import graphs
from worker.engines.native.block_manager import BlockManager, BlockTable
from worker.engines.native.engine import NativeEngine
from worker.engines.native.graphs import HostInputs
from worker.request import GenerationRequest, SamplingParams

BLOCK = 4


def sequence(length: int) -> SimpleNamespace:
    """What HostInputs reads of a Sequence."""
    return SimpleNamespace(tokens=list(range(length)), num_cached=length - 1, blocks=BlockTable(), draft=[],
                           scores_prompt=False)


def written(inputs: HostInputs, rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions, slots and lengths, and the block tables, of the first `rows` rows."""
    return inputs.packed.numpy()[1:, :rows].copy(), inputs.tables.numpy()[:rows, :width].copy()


def test_a_step_launched_ahead_writes_what_a_full_pass_writes():
    blocks = BlockManager(200, BLOCK, prefix_caching=False)
    seqs = [sequence(length) for length in (1, 3, 4, 7, 9)]
    ahead = HostInputs(8, 16, pin=False)
    advanced = []  # the steps that took the short way
    step_on = ahead._next_token
    ahead._next_token = lambda *args: advanced.append(step) or step_on(*args)
    rows = seqs
    for step in range(23):
        for seq in seqs:  # the engine grows each table to hold the pending token first
            blocks.grow(seq.blocks, len(seq.tokens) + 1)
        if step == 11:  # the same rows in a new list: a full pass
            rows = list(seqs)
        got = ahead.fill(rows, BLOCK, ahead=True)
        full = HostInputs(8, 16, pin=False)
        expected = full.fill(rows, BLOCK, ahead=True)
        assert got == expected, step
        for mine, theirs in zip(written(ahead, *got), written(full, *expected)):
            np.testing.assert_array_equal(mine, theirs, err_msg=f"step {step}")
        for seq in seqs:
            seq.tokens.append(step)
            seq.num_cached = len(seq.tokens) - 1
        if step == 17:  # a row two tokens on (not a step launched ahead of the last): a full pass
            seqs[2].tokens.append(0)
            blocks.grow(seqs[2].blocks, len(seqs[2].tokens) + 1)
    positions = ahead.packed.numpy()[1, :len(seqs)]
    assert positions.tolist() == [len(seq.tokens) - 1 for seq in seqs]
    # All but the first step, the new list's and the one after the jump advanced the last inputs.
    assert advanced == [s for s in range(23) if s not in (0, 11, 18)]


def test_rows_of_proposals_and_prompt_chunks_are_the_decode_rows_batch_of_packs():
    """A step with a decode, a row with proposals and a short prompt chunk (after a cached block)
    runs in the graphs as a row per token: each token's id, position, slot, length and table are
    what batch_of packs for the same rows as one-token decodes, and only the chunk's last row and
    every proposal row keep their logits."""
    import torch

    from worker.engines.native.sequence import DecodeRows, batch_of, logit_rows

    blocks = BlockManager(200, BLOCK, prefix_caching=False)
    decode, drafting, prompt = sequence(6), sequence(9), sequence(11)
    drafting.draft = [70, 71, 72]
    prompt.num_cached = BLOCK  # its first block came from the prefix cache
    scheduled = [(decode, 1), (drafting, 4), (prompt, 7)]
    for seq, count in scheduled:
        blocks.grow(seq.blocks, seq.num_cached + count)
    inputs = HostInputs(16, 16, pin=False)
    rows, width = inputs.fill_rows(scheduled, BLOCK)
    batch = batch_of(scheduled, BLOCK, torch.device("cpu"), DecodeRows(context=float("inf")))
    assert not batch.prefills and batch.query_lens == [1] * 12 and rows == 12
    ids, positions, slots, lens = inputs.packed.numpy()[:, :rows]
    assert ids.tolist() == batch.input_ids.tolist() == [5, 8, 70, 71, 72, *range(4, 11)]
    assert positions.tolist() == batch.positions.tolist()
    assert slots.tolist() == batch.slots.tolist()
    assert lens.tolist() == batch.context_lens == [6, 9, 10, 11, 12, *range(5, 12)]
    for row, table in enumerate(batch.block_tables):
        np.testing.assert_array_equal(inputs.tables.numpy()[row, :len(table)], table)
    assert width == max(len(t) for t in batch.block_tables)
    assert logit_rows(scheduled) == batch.last_token_index.tolist() == [0, 1, 2, 3, 4, 11]


def test_prompts_joining_a_step_launched_ahead_follow_its_decode_rows():
    """A step launched ahead with short prompts admitted: the decodes' rows, one token further
    each (their ids come from the device), then a row per prompt token, each as a full pass
    over the same rows writes them."""
    blocks = BlockManager(200, BLOCK, prefix_caching=False)
    decodes = [sequence(length) for length in (3, 4, 8)]
    prompt = sequence(7)
    prompt.num_cached = BLOCK  # its first block came from the prefix cache
    for seq in decodes:
        blocks.grow(seq.blocks, len(seq.tokens) + 1)
    blocks.grow(prompt.blocks, len(prompt.tokens))
    inputs = HostInputs(16, 16, pin=False)
    inputs.fill(decodes, BLOCK, ahead=True)  # the step before, launched ahead of the same rows
    for seq in decodes:
        seq.tokens.append(0)
        seq.num_cached += 1
        blocks.grow(seq.blocks, len(seq.tokens) + 1)
    first, width = inputs.fill(decodes, BLOCK, ahead=True)
    rows, more = inputs.fill_rows([(prompt, 3)], BLOCK, start=first)
    # The same rows in one pass: each decode as a row of its pending token.
    for seq in decodes:
        seq.num_cached = len(seq.tokens)
        seq.tokens.append(-1)
    full = HostInputs(16, 16, pin=False)
    expected = full.fill_rows([*((seq, 1) for seq in decodes), (prompt, 3)], BLOCK)
    assert (rows, max(width, more)) == expected == (6, 3)
    for mine, theirs in zip(written(inputs, *expected), written(full, *expected)):
        np.testing.assert_array_equal(mine, theirs)
    assert inputs.packed.numpy()[0, first:rows].tolist() == [4, 5, 6]  # the prompt's own ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode graphs run on CUDA")
async def test_inputs_read_from_the_host_by_a_kernel_give_the_tokens_of_copies(tiny_llama, monkeypatch):
    """Graph steps whose inputs the feed kernel reads from pinned memory (with the pending tokens of
    steps launched ahead, rows of ended sequences left out) give the tokens of the same steps with
    the inputs copied in, greedy and seeded, alone and batched; every block comes back."""
    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                  "engine.dtype": "float32", "engine.device": "cuda"})
    fed, run = [], graphs.DecodeGraphs.run

    def spy(self, n, width, input_ids=None, distinct=False):
        fed.append(n * width * self.tables.element_size() <= graphs.FEED_BYTES)
        return run(self, n, width, input_ids, distinct)

    monkeypatch.setattr(graphs.DecodeGraphs, "run", spy)
    engine = NativeEngine(config)
    await engine.load_model()

    async def tokens(index: int, max_tokens: int, **sampling) -> list[int]:
        request = GenerationRequest(request_id=f"f{index}", prompt_token_ids=[2 + (5 * index + 3 * j) % 500 for j in range(7 + index)],
                                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
        return [t async for out in engine.stream_predict(request) for t in out.token_ids]

    results = []
    try:
        for feed in (graphs.FEED_BYTES, -1):
            monkeypatch.setattr(graphs, "FEED_BYTES", feed)
            fed.clear()
            runs = [await tokens(0, 40)]
            for sampling in ({}, {"temperature": 0.8, "top_k": 50, "seed": 3}):
                runs.append(await asyncio.gather(*(tokens(i, 10 + 7 * i, **sampling) for i in range(6))))
            results.append(runs)
            assert (all(fed) if feed > 0 else not any(fed)) and len(fed) > 40
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()
    assert results[0] == results[1]

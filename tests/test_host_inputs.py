"""The CUDA decode graphs' host inputs (graphs.HostInputs), which run on the CPU: a step launched
ahead of the same rows advances the last step's inputs instead of rewriting them, and must write
what a full pass writes."""

from types import SimpleNamespace

import numpy as np

from worker.engines.native.block_manager import BlockManager, BlockTable
from worker.engines.native.graphs import HostInputs

BLOCK = 4


def sequence(length: int) -> SimpleNamespace:
    """What HostInputs reads of a Sequence."""
    return SimpleNamespace(tokens=list(range(length)), num_cached=length - 1, blocks=BlockTable(), draft=[])


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

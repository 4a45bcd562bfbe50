"""How the decode-attention kernel splits contexts (paged_decode.launch): in a step of many sequences
with a context past LONG_CONTEXT, the longest contexts in parts beside the others whole; in a step of
few, every context past WHOLE_TILES tiles. The kernel runs here on the CPU through Triton's
interpreter, in a process of its own (the interpreter is chosen when the kernels are defined), with
the launch's sizes shrunk so that a few rows make it; tests/test_cuda_kernels.py runs it compiled on
a GPU."""

import textwrap

import pytest
import torch

from tests import interpreter

pytest.importorskip("triton")

SHRUNK = """
import torch
import triton
import triton.language as tl
from worker.engines.native import paged_decode as pd
from worker.engines.native.attention import gather_attention

# 2 KV heads: 4 programs make a step "many"; long past 100 tokens; 3 long rows in up to 4 parts, of
# which a launch takes 2 (its 4 arrivals count 2 rows' 2 heads: launch)
pd.SPLIT_PROGRAMS, pd.LONG_ROWS, pd.LONG_SPLITS, pd.LONG_CONTEXT = 4, 3, 4, 100
assert pd.launch(6, 2, True) == (4, 2) and pd.launch(6, 2, False) == (1, 0)


def caches(lens, kv_heads=2, dim=32, block=16):
    needs = [-(-n // block) + 1 for n in lens]
    perm = torch.randperm(sum(needs)).to(torch.int32)
    tables = torch.zeros(len(lens), max(needs), dtype=torch.int32)
    at = 0
    for row, need in enumerate(needs):
        tables[row, :need] = perm[at:at + need]
        at += need
    k = torch.randn(sum(needs) * block, kv_heads, dim)
    return k, torch.randn_like(k), tables, torch.tensor(lens, dtype=torch.int32)
"""


def interpreted(body: str) -> str:
    """stdout of SHRUNK then body, run under Triton's interpreter in a process of its own."""
    return interpreter.interpreted(SHRUNK + textwrap.dedent(body))


@interpreter.only
def test_long_rows_are_the_longest_few_past_the_bar_and_each_gets_one_slot():
    """Which rows the parts take (long_row, by slot) and which the whole-row programs leave
    (is_long_row): past LONG_CONTEXT and a quarter of the longest, or half, or the longest, the
    first of those bars that leaves at most LONG_ROWS, else none; in row order; a padding row (0)
    never. The host's count (long_rows, which picks the decode graph) agrees."""
    out = interpreted("""
        @triton.jit
        def pick(lens_ptr, slots_ptr, longs_ptr, batch, ROWS: tl.constexpr):
            i = tl.program_id(0)
            if i < 3:
                tl.store(slots_ptr + i, pd.long_row(lens_ptr, batch, i, 100, 3, ROWS))
            tl.store(longs_ptr + i, pd.is_long_row(lens_ptr, batch, i, 100, 3, ROWS).to(tl.int32))

        for lens in ([30, 700, 5, 0, 450, 120, 20, 1000], [30, 50, 5, 0, 101, 60, 10, 20],
                     [300, 700, 500, 260, 450, 420, 380, 1000], [500, 500, 500, 500, 90, 0, 20, 30],
                     [900, 500, 500, 500, 90, 0, 20, 30]):
            slots, longs = torch.full((3,), -7, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
            pick[(8,)](torch.tensor(lens, dtype=torch.int32), slots, longs, 8, ROWS=8)
            print(slots.tolist(), longs.tolist(), pd.long_rows(lens, 3) == int(longs.sum()))
    """)
    assert out.splitlines() == [
        "[1, 4, 7] [0, 1, 0, 0, 1, 0, 0, 1] True",  # past 250, a quarter of 1,000: 120 is past 100, not that
        "[4, -1, -1] [0, 0, 0, 0, 1, 0, 0, 0] True",  # one long row; the other slots have none
        "[1, 7, -1] [0, 1, 0, 0, 0, 0, 0, 1] True",  # eight past 250: those past 500
        "[-1, -1, -1] [0, 0, 0, 0, 0, 0, 0, 0] True",  # four tied: splitting three would gain nothing
        "[0, -1, -1] [1, 0, 0, 0, 0, 0, 0, 0] True",  # four past a quarter and past half: the longest alone
    ]


@interpreter.only
def test_a_step_with_long_rows_splits_those_rows_and_walks_the_others_whole():
    """Mixed contexts through the long launch, fp32, against the gather path and, to the bit, each
    long row (here those past half the longest: launch gives 2 slots) as a launch splitting every
    context in 4 parts gives it and every other row as the launch splitting none does (a long row
    also walked whole would end with the whole walk's bits); twice, so every arrival went back to
    0. The same bits where the programs with nothing to walk leave before the wait (LEAVE_EARLY).
    With the rotary embedding and cache write inside: the caches and output the short launch gives,
    those programs leaving or not."""
    out = interpreted("""
        torch.manual_seed(0)
        for lens, long in (([30, 700, 5, 0, 450, 1000], {1, 5}), ([300, 700, 500, 260, 450, 1000], {1, 5}),
                           ([30, 50, 5, 0, 101, 60], {4})):
            k, v, tables, row_lens = caches(lens)
            q = torch.randn(len(lens), 8, 32)
            pd.SPLIT_PROGRAMS = 48  # every context in 4 parts (and the arrivals made for 48 rows' heads)
            assert pd.launch(6, 2, True) == (4, 0)
            split = pd.paged_decode(q, k, v, tables, row_lens, 16, long=True)
            pd.SPLIT_PROGRAMS = 4
            whole = pd.paged_decode(q, k, v, tables, row_lens, 16, long=False)
            want = torch.stack([split[row] if row in long else whole[row] for row in range(len(lens))])
            for pd.LEAVE_EARLY in ((), ((32, 64),), ((32, 64),)):
                got = pd.paged_decode(q, k, v, tables, row_lens, 16, long=True)
                err = (got - gather_attention(q, k, v, tables, row_lens, 16)).abs().max().item()
                print(err < 1e-5, torch.equal(got, want), pd._ARRIVALS[torch.device("cpu")].abs().sum().item())
        lens = [30, 700, 5, 0, 450, 1000]
        k, v, tables, row_lens = caches(lens)
        slots = torch.tensor([int(tables[i, max(n - 1, 0) // 16]) * 16 + max(n - 1, 0) % 16 for i, n in enumerate(lens)])
        new = torch.randn(len(lens), 2 * 2, 32)
        angles = torch.randn(len(lens), 16).repeat(1, 2)
        rope = (new[:, :2], new[:, 2:], angles.cos(), angles.sin(), slots)
        q = torch.randn(len(lens), 8, 32)
        runs = []
        for long, pd.LEAVE_EARLY in ((False, ()), (True, ()), (True, ((32, 64),))):
            kc, vc = k.clone(), v.clone()
            runs.append((pd.paged_decode(q, kc, vc, tables, row_lens, 16, long=long, rope=rope), kc, vc))
        b, kb, vb = runs[0]
        for a, ka, va in runs[1:]:
            print((a - b).abs().max().item() < 1e-5, torch.equal(ka, kb), torch.equal(va, vb), not torch.equal(ka, k))
    """)
    assert out.splitlines() == ["True True 0"] * 9 + ["True True True True"] * 2


@interpreter.only
def test_a_step_of_few_rows_splits_each_context_past_two_tiles():
    """Where few programs run, every context past WHOLE_TILES 64-token tiles is walked in parts that
    the last one combines, and shorter ones whole: fp32, against the gather path; a context of up to
    2 tiles to the bit as a launch walking every context whole gives it, a longer one with the
    combine's bits instead; twice, to the bit, every arrival back to 0."""
    out = interpreted("""
        torch.manual_seed(0)
        pd.SPLIT_PROGRAMS = 256  # as shipped: 5 rows of 2 KV heads split
        lens = [100, 128, 129, 300, 384]  # 2, 2, 3, 5 and 6 tiles
        k, v, tables, row_lens = caches(lens)
        q = torch.randn(len(lens), 8, 32)
        assert pd.launch(len(lens), 2, False)[0] > 1
        split = [pd.paged_decode(q, k, v, tables, row_lens, 16) for _ in range(2)]
        whole_tiles, pd.WHOLE_TILES = pd.WHOLE_TILES, 1 << 10
        whole = pd.paged_decode(q, k, v, tables, row_lens, 16)
        err = (split[0] - gather_attention(q, k, v, tables, row_lens, 16)).abs().max().item()
        print(whole_tiles, err < 1e-5, torch.equal(split[0], split[1]), pd._ARRIVALS[torch.device("cpu")].abs().sum().item())
        print([torch.equal(split[0][row], whole[row]) for row in range(len(lens))])
    """)
    assert out.splitlines() == ["2 True True 0", "[True, True, False, False, False]"]


def test_a_step_takes_the_long_launch_only_where_it_splits_a_context():
    """Batch.prepare's choice for an eager step (paged_decode.takes_long; the decode graphs choose
    theirs by the same rule): with Llama's 8 KV heads, few rows split every context past 2,048
    tokens; many rows take the long launch only where it has long rows to split."""
    from worker.engines.native.batch import Batch

    def long_launch(contexts: list[int]) -> bool:
        ids = torch.zeros(len(contexts), dtype=torch.long)
        tables = [[0] * -(-context // 16) for context in contexts]
        batch = Batch(ids, ids, ids, [1] * len(contexts), contexts, tables, torch.arange(len(contexts)), 16)
        return batch.prepare(64, 8).long_contexts

    assert long_launch([3000] * 4)  # 32 programs: every context in more parts
    assert not long_launch([3000] * 64)  # none to split: the short launch, as before long rows
    assert long_launch([32768] + [256] * 63) and long_launch([8192] * 4 + [3000] * 60)
    assert not long_launch([256] * 64) and not long_launch([2048] * 4)

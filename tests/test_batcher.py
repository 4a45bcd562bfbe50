"""The native engine's Batcher on the host: the rows of a decode step launched ahead of its
predecessor's tokens (ahead.decodes), and which waiting prompts may join it."""

from types import SimpleNamespace

from worker.engines.native.batcher import Batcher
from worker.engines.native.block_manager import BlockManager, BlockTable
from worker.engines.native.pacer import PrefillPacer
from worker.engines.native.sequence import DecodeRows
from worker.engines.native.speculation import Proposer, Settings, Speculator

BLOCK = 4
CONFIG = SimpleNamespace(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
GRAPH_ROWS = DecodeRows(context=float("inf"))


def batcher(num_blocks: int = 64, max_num_seqs: int = 8) -> Batcher:
    blocks = BlockManager(num_blocks, BLOCK, prefix_caching=True)
    speculator = Speculator(Settings(0, 2, 4, False, 0.5))
    return Batcher(blocks, PrefillPacer(CONFIG, 0.25), speculator, 2048, max_num_seqs, True, lambda seq: None)


def prompt(tokens, scored: bool = False) -> SimpleNamespace:
    """What the Batcher reads of a Sequence."""
    return SimpleNamespace(tokens=list(tokens), num_cached=0, blocks=BlockTable(), draft=[], scores_prompt=scored,
                           done=False, end=1 << 62)


def decoding(lanes: Batcher, length: int) -> SimpleNamespace:
    """A running sequence whose last token is being sampled: its cache holds the ones before."""
    seq = prompt(range(200, 200 + length))
    seq.num_cached = length - 1
    lanes.blocks.grow(seq.blocks, length)
    lanes.running.append(seq)
    return seq


def test_short_prompts_join_whole_after_a_cached_prefix_within_the_rows():
    lanes = batcher()
    cached = prompt(range(10, 22))
    lanes.blocks.grow(cached.blocks, 12)
    lanes.blocks.commit(cached.blocks, cached.tokens, 12)  # three full blocks, named for sharing
    at_edge, inside = decoding(lanes, 4), decoding(lanes, 6)
    after, fresh, third = prompt([*range(10, 22), 5, 6]), prompt(range(30, 36)), prompt(range(40, 46))
    for seq in (after, fresh, third):
        lanes.add(seq)
    rows = lanes.ahead([at_edge, inside], rows=12, fits=GRAPH_ROWS)
    # 10 rows after the decodes: the cached prompt computes its last 2 tokens, the fresh one all 6;
    # the third's 6 do not fit and it waits, holding nothing.
    assert rows == [(at_edge, 1), (inside, 1), (after, 2), (fresh, 6)]
    assert len(at_edge.blocks.blocks) == 2 and len(inside.blocks.blocks) == 2  # room for the pending tokens
    assert after.num_cached == 12 and lanes.prefix_hit_tokens == 12
    assert lanes.running == [at_edge, inside, after, fresh] and list(lanes.waiting) == [third]
    assert not third.blocks.blocks and len(after.blocks.blocks) == 4 and len(fresh.blocks.blocks) == 2


def test_a_burst_of_prompts_goes_to_the_host_step_whole():
    """Prompts left waiting past another step's rows go to a step on the host, which takes them in
    chunks of max_batched_tokens: the ones that would have joined go back as they were, the
    cached prefix they matched included."""
    lanes = batcher()
    cached = prompt(range(10, 22))
    lanes.blocks.grow(cached.blocks, 12)
    lanes.blocks.commit(cached.blocks, cached.tokens, 12)
    lanes.blocks.release(cached.blocks)  # its blocks free, their names kept for the next to match
    running = decoding(lanes, 3)
    burst = [prompt([*range(10, 22), 5, 6])] + [prompt(range(30 + 10 * i, 36 + 10 * i)) for i in range(5)]
    for seq in burst:
        lanes.add(seq)
    free = lanes.blocks.num_free
    # 11 rows after the decode: the first (2 new tokens after its cached 12) and the second would
    # join; the 24 tokens left over are more than another step's 12 rows.
    assert lanes.ahead([running], rows=12, fits=GRAPH_ROWS) is None
    assert list(lanes.waiting) == burst and lanes.running == [running]
    assert all(not seq.blocks.blocks and seq.num_cached == 0 for seq in burst)
    assert lanes.blocks.num_free == free and lanes.prefix_hit_tokens == 0 and lanes.prefix_queried_tokens == 0
    # The host step then takes the burst in one chunk, the first after its cached prefix still.
    assert lanes.schedule() == [(running, 1), (burst[0], 2)] + [(seq, 6) for seq in burst[1:]]
    assert burst[0].num_cached == 12 and lanes.prefix_hit_tokens == 12


def test_the_oldest_waiting_one_that_cannot_join_keeps_the_step_on_the_host():
    """A prompt too long for the rows' bound, or scored for prompt logprobs (every position's
    logits), must be scheduled once the last step is read: None, and no prompt takes anything."""
    for refused in (prompt(range(2, 40)), prompt(range(2, 6), scored=True)):
        lanes = batcher()
        running = decoding(lanes, 3)
        lanes.add(refused)
        lanes.add(prompt(range(50, 53)))
        free = lanes.blocks.num_free
        assert lanes.ahead([running], rows=64, fits=DecodeRows(context=float("inf"), pairs=300)) is None
        assert lanes.blocks.num_free == free and not refused.blocks.blocks and lanes.running == [running]


def test_a_prompt_kept_out_by_slots_or_blocks_does_not_stop_the_step_going_ahead():
    """What no step could admit now (every slot taken, too few free blocks) waits either way: the
    decodes still go ahead, with nothing joined."""
    lanes = batcher(max_num_seqs=1)
    running = decoding(lanes, 3)
    lanes.add(prompt(range(2, 6)))
    assert lanes.ahead([running], rows=16, fits=GRAPH_ROWS) == [(running, 1)]
    lanes = batcher(num_blocks=2)
    running = decoding(lanes, 3)
    lanes.add(prompt(range(2, 14)))
    assert lanes.ahead([running], rows=16, fits=GRAPH_ROWS) == [(running, 1)] and lanes.blocks.num_free == 1


def test_no_step_goes_ahead_of_a_token_that_finds_no_block():
    lanes = batcher(num_blocks=1)
    full = decoding(lanes, 4)  # its one block is full: the pending token needs another
    assert lanes.ahead([full], rows=16, fits=GRAPH_ROWS) is None and len(full.blocks.blocks) == 1


def test_with_overlap_no_proposals_take_the_rows_of_a_prompt_that_joins():
    """On CUDA a prompt that joins a step runs as graph rows beside the decodes; a step that also
    verified every sequence's proposals outgrew the graphs and ran eager, so while a prompt waits
    for a free slot the decodes propose nothing. Once it is in, they propose again."""
    settings = Settings(4, 2, 4, True, 0.5)
    for overlap, proposes_beside_it in ((True, False), (False, True)):
        blocks = BlockManager(64, BLOCK, prefix_caching=True)
        lanes = Batcher(blocks, PrefillPacer(CONFIG, 0.25), Speculator(settings), 2048, 2, overlap, lambda seq: None)
        seq = decoding(lanes, 6)
        seq.tokens = [7, 8, 9, 7, 8, 9]  # "7 8" came before, followed by 9 7 8 9 ...
        seq.proposer = Proposer(settings)
        joining = prompt(range(30, 36))
        joining.proposer = None
        lanes.add(joining)
        rows = lanes.schedule()
        assert rows[0] == (seq, 5 if proposes_beside_it else 1), overlap
        assert [count for _, count in rows[1:]] == [6], "the prompt joined whole"
        seq.num_cached, seq.draft = len(seq.tokens) - 1, []
        blocks.release(seq.blocks)
        seq.blocks = BlockTable()
        blocks.grow(seq.blocks, len(seq.tokens))
        assert lanes.schedule()[0] == (seq, 5), "no prompt waits: the sequence proposes"


def test_a_burst_of_short_prompts_beside_decodes_joins_within_the_pacers_time():
    """Only a step's first prompt chunk gets MIN_CHUNK whatever the time: short prompts that
    arrive together join as the pacer's target allows, not all at once beside the decodes."""
    lanes = batcher(num_blocks=256, max_num_seqs=32)
    running = [decoding(lanes, 9) for _ in range(2)]
    burst = [prompt(range(10 * i, 10 * i + 7)) for i in range(1, 11)]
    for seq in burst:
        lanes.add(seq)
    pacer = lanes.pacer
    decodes = 2 * pacer.work(1, 8)
    # Measured so the target holds the decodes and three and a half 7-token prompts.
    pacer.record(decodes + 3.5 * pacer.work(7, 0), pacer.target_s, 16)
    step = lanes.schedule()
    assert step[:2] == [(seq, 1) for seq in running]
    assert step[2:5] == [(seq, 7) for seq in burst[:3]]
    assert step[5][0] is burst[3] and 0 < step[5][1] < 7  # a chunk of what is left: it goes on next step
    assert lanes.running == [*running, *burst[:3]] and list(lanes.waiting) == burst[3:]
    assert all(not seq.blocks.blocks for seq in burst[4:])  # waiting ones hold nothing
    for seq, count in step:  # read, as the engine's _read counts them
        seq.num_cached += count
    step = lanes.schedule()  # the partial prompt goes on first
    assert step[5] == (burst[3], 7 - burst[3].num_cached) and burst[3] in lanes.running

"""Speculative decoding's rules in the native engine: the n-gram proposer, what a row costs a step,
the speculator's choices (what is scheduled, proposed, cut, forgotten) and the verification rules
(greedy and rejection sampling). The engine speculating end to end: test_speculating_engine.py."""

import pytest
import torch

from worker.engines.native.speculation import EXPLORE_STEPS, PAUSE_STEPS, Proposer, Settings, Speculator, StepCost, verify
from worker.engines.sampler import Draws
from worker.request import GenerationRequest, SamplingParams

SETTINGS = Settings(num_tokens=4, ngram_min=2, ngram_max=3, by_default=True, min_accepted=0.5)


def test_the_proposer_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    proposer = Proposer(SETTINGS)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 4, 6, 7]
    assert proposer.propose(tokens, limit=10) == [2, 3, 4, 6], "(6, 7) last occurred at 6-7, followed by 2, 3, 4, 6"
    assert proposer.propose(tokens + [8], limit=10) == [9, 1, 6, 7], "(6, 7, 8) beats (7, 8): 3 tokens matched"
    assert proposer.propose(tokens + [8], limit=2) == [9, 1], "no more than the request's remaining tokens"
    assert Proposer(SETTINGS).propose([1, 2, 3, 4], limit=10) == [], "no earlier occurrence"
    assert Proposer(SETTINGS).propose([1, 2, 1, 2], limit=10) == [1, 2, 1, 2], "a loop goes on past the suffix"
    assert Proposer(SETTINGS).propose([9, 5, 5, 5], limit=3) == [5, 5, 5]


def test_proposals_after_a_draft_launched_ahead_follow_its_source():
    """A check launched before the last one is read (ahead.checks) proposes what follows in
    the same source, past the token the model adds after the draft."""
    proposer = Proposer(SETTINGS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # (2, 3) at 1-2: followed by 4, 5, 6, 7
    assert proposer.propose(tokens, limit=10) == [4, 5, 6, 7]
    proposer.drafted(2)  # [4, 5] launched: the model's next is 6 if it copies on
    assert proposer.follow(tokens, limit=4) == [7, 1, 2, 3]
    assert proposer.follow(tokens, limit=2) == [5, 6], "a loop of period 7 goes on: 4 from the model, then 5, 6"
    looping = Proposer(SETTINGS)
    assert looping.propose([9, 1, 2, 1, 2], limit=3) == [1, 2, 1]
    assert looping.follow([9, 1, 2, 1, 2], limit=3) == [1, 2, 1], "after 1, 2, 1 and the model's 2"


def test_a_sequence_whose_proposals_fail_pauses_longer_each_time():
    proposer = Proposer(SETTINGS)
    tokens = [1, 2, 3] * 4
    pauses = []
    for _ in range(3):
        while proposer.active:
            assert proposer.propose(tokens, 10)
            proposer.record(0)
        skipped = 0
        while not proposer.propose(tokens, 10):
            skipped += 1
        pauses.append(skipped)
        proposer.record(0)
    assert pauses == [PAUSE_STEPS[0], 2 * PAUSE_STEPS[0], 4 * PAUSE_STEPS[0]]
    for _ in range(8):  # accepted again: the pause it next takes is the first one
        proposer.record(4)
    while proposer.active:
        proposer.propose(tokens, 10)
        proposer.record(0)
    assert sum(not proposer.propose(tokens, 10) for _ in range(PAUSE_STEPS[0] + 1)) == PAUSE_STEPS[0]


def test_step_cost_fits_what_a_row_costs_once_the_rows_vary():
    cost = StepCost()
    for _ in range(20):
        cost.record(8, 0.030)
    assert cost.fit() is None, "steps of one size say nothing of a row's cost"
    for step in range(60):
        rows = 8 + step % 5 * 4
        cost.record(rows, 0.020 + 0.0012 * rows)
    base, per_row = cost.fit()
    assert abs(per_row - 0.0012) < 1e-4 and abs(base - 0.020) < 2e-3


def test_one_slow_step_does_not_price_the_rows_after_it():
    """A step that compiled a kernel or waited out a garbage collection counts as StepCost.OUTLIER
    times the fit's time for its rows: a row's cost stays near what the steps around it say."""
    cost = StepCost()
    for step in range(60):
        rows = 1 + step % 3 * 4
        cost.record(rows, 0.0004 + 0.00002 * rows)
    cost.record(9, 0.040)  # a hundred times its time
    for step in range(10):
        rows = 1 + step % 3 * 4
        cost.record(rows, 0.0004 + 0.00002 * rows)
    base, per_row = cost.fit()
    assert per_row < 0.00006 and abs(base - 0.0004) < 0.0002


def test_forgetting_takes_a_speculator_back_to_a_new_one():
    """What the warm-up's steps taught (warmup.py; their times include compiles) and counted goes."""
    speculator = Speculator(SETTINGS)
    for rows in (1, 5, 9, 1, 5, 9):
        speculator.step_cost.record(rows, 0.1 * rows)
    speculator.record_period(chained=True, tokens=8, seqs=8, seconds=0.001)
    speculator.record_period(chained=False, tokens=8, seqs=8, seconds=0.1)
    speculator.drafts, speculator.recent = 3, 0.5
    assert speculator.step_cost.fit() is not None and not speculator.schedules_next()
    speculator.forget()
    assert speculator.step_cost.fit() is None and speculator.stats() == (0, 0, 0)
    assert speculator.recent == SETTINGS.num_tokens and speculator.schedules_next()


def test_with_overlap_a_proposing_step_is_scheduled_only_while_scheduling_gives_more_tokens():
    """On CUDA a step whose sequences may propose gives up its launch ahead: that happens while
    either rate is unmeasured, while scheduled steps have lately given more tokens a second a
    sequence than steps launched ahead, and otherwise once an exploration interval has passed,
    so the scheduled rate stays measured; the interval doubles while explorations lose, up to a
    bound, and starts again from the first once scheduling wins."""
    first, last = EXPLORE_STEPS
    speculator = Speculator(SETTINGS)
    assert speculator.schedules_next(), "nothing measured yet"
    speculator.record_period(chained=True, tokens=8, seqs=8, seconds=0.001)  # 1,000 tokens/s a sequence
    assert speculator.schedules_next(), "scheduled steps not measured yet"
    speculator.record_period(chained=False, tokens=16, seqs=8, seconds=0.004)  # 500: launching ahead wins
    scheduled = [speculator.schedules_next() for _ in range(7 * first)]
    assert [i for i, s in enumerate(scheduled) if s] == [first - 1, 3 * first - 1, 7 * first - 1], \
        "explorations come after 32, 64, 128 steps"
    gaps = []
    for _ in range(3):
        steps = 1
        while not speculator.schedules_next():
            steps += 1
        gaps.append(steps)
    assert gaps == [8 * first, last, last], "doubled up to the bound, and no further"
    for _ in range(10):  # copied text: 4 tokens a verify in 2 ms, 2,000 a second a sequence
        speculator.record_period(chained=False, tokens=32, seqs=8, seconds=0.002)
    assert all(speculator.schedules_next() for _ in range(first))
    for _ in range(10):  # launching ahead got faster still
        speculator.record_period(chained=True, tokens=8, seqs=8, seconds=0.0004)
    assert sum(speculator.schedules_next() for _ in range(first)) == 1, "the interval started again from the first"
    speculator.record_period(chained=True, tokens=0, seqs=0, seconds=0.001)  # an empty step is not a rate
    speculator.record_period(chained=True, tokens=8, seqs=8, seconds=0.0)
    assert sum(speculator.schedules_next() for _ in range(2 * first)) == 1


def test_a_proposal_left_out_is_tried_again_later():
    proposer = Proposer(SETTINGS)
    for _ in range(3):
        proposer.record(0)
    low = proposer.expected
    assert low < 2
    for _ in range(30):
        proposer.skipped(4.0)
    assert proposer.expected > low + 1, "its estimate drifts back toward k, so it gets checked again"


def test_a_new_sequence_starts_from_what_checks_lately_accepted():
    """At batch 8 on a CPU a proposal pays only where it adds ~3 of 4 tokens: a new sequence
    expects what the engine's recent checks accepted, not k, so text that seldom repeats does not
    pay for a first round of checks in every sequence."""
    speculator = Speculator(SETTINGS)
    request = GenerationRequest(request_id="r", sampling=SamplingParams(), speculative=True)
    assert speculator.proposer_for(request, plain=True).expected == SETTINGS.num_tokens, "nothing checked yet"
    for _ in range(100):
        row = Row([3, 4, 5])
        row.done, row.proposer = False, Proposer(SETTINGS)
        assert speculator.check([row], [row.draft], one_hot([0, 4, 5, 1])) == [(row, [0])], "the first proposal rejected"
    assert speculator.proposer_for(request, plain=True).expected < 1


def test_a_draft_is_cut_where_its_last_tokens_no_longer_pay_for_their_rows():
    """A sequence whose proposed tokens are accepted about 2 times in 3: where a row costs a step
    next to nothing (batch 1 on a CPU) its whole draft goes in; where a row costs half a decode's
    worth (batch 8) the draft is cut to the tokens likely enough to be accepted to pay; a sequence
    whose tokens are nearly always accepted (a copy) keeps its whole draft even there."""
    from types import SimpleNamespace

    from worker.engines.native.block_manager import BlockManager, BlockTable

    def proposer(accepted, proposed, checks=12):
        made = Proposer(SETTINGS)
        for _ in range(checks):
            made.record(accepted, proposed)
        return made

    def drafts(per_row_s, proposers):
        speculator, blocks = Speculator(SETTINGS), BlockManager(64, 16)
        for step in range(40):  # a step costs 20 ms + per_row_s a row
            rows = 8 + step % 5 * 4
            speculator.step_cost.record(rows, 0.020 + per_row_s * rows)
        tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # (2, 3) occurred before: [4, 5, 6, 7] proposed
        scheduled = []
        for made in proposers:
            seq = SimpleNamespace(proposer=made, tokens=list(tokens), end=100, num_cached=9, draft=[],
                                  blocks=BlockTable())
            blocks.grow(seq.blocks, 10)
            scheduled.append((seq, 1))
        scheduled += [(SimpleNamespace(proposer=None), 1)] * (8 - len(proposers))
        speculator.propose(scheduled, blocks, overlap=False)
        return [len(seq.draft) for seq, _ in scheduled[:len(proposers)]]

    sometimes, copying = proposer(2, 4), proposer(4, 4)  # 2 of 3 checked tokens accepted; every one
    assert drafts(0.0001, [sometimes]) == [4], "rows nearly free: the whole draft"
    cut = drafts(0.002, [sometimes, copying])
    assert 1 <= cut[0] < 4 and cut[1] == 4, cut


class Row:
    def __init__(self, draft, temperature=0.0, seed=0, top_k=0):
        self.draft = draft
        self.request = GenerationRequest(request_id="r", sampling=SamplingParams(temperature=temperature, top_k=top_k))
        self.generator = Draws(seed)


def one_hot(ids: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.full((len(ids), vocab), -5.0)
    logits[range(len(ids)), ids] = 5.0
    return logits


def test_greedy_verification_takes_proposals_while_they_are_the_argmax_then_one_more():
    rows = [Row([3, 4, 5]), Row([1, 1]), Row([2, 6])]
    # Row 0: the model says 3, 4, 7 (rejects 5), then 2; row 1: 0 first; row 2: takes both, then 5.
    logits = torch.cat([one_hot([3, 4, 7, 2]), one_hot([0, 1, 1]), one_hot([2, 6, 5])])
    assert verify(logits, rows, [row.draft for row in rows]) == [[3, 4, 7], [0], [2, 6, 5]]
    chosen = logits.argmax(dim=-1).tolist()  # copied over by the step (Step.check): the logits not read again
    assert verify(torch.zeros_like(logits), rows, [row.draft for row in rows], chosen) == [[3, 4, 7], [0], [2, 6, 5]]


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_sampling_keeps_the_model_s_distribution(top_k):
    """With the proposal fixed, the first token over 6,000 seeds is distributed as the model says
    (top-k applied), and a proposal is followed by a second token exactly when it was accepted.
    Accepting every proposal moves the distribution far past the bound."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]] * 2)
    p = torch.softmax(logits[0], dim=-1)
    if top_k:
        p[top_k:] = 0
        p /= p.sum()
    counts = torch.zeros(6)
    trials = 6000
    for seed in range(trials):
        tokens = verify(logits, [Row([1], temperature=1.0, seed=seed, top_k=top_k)], [[1]])[0]
        counts[tokens[0]] += 1
        assert len(tokens) == 2 if tokens[0] == 1 else len(tokens) == 1
    assert 0.5 * (counts / trials - p).abs().sum() < 0.025, (counts / trials, p)

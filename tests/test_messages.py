"""The native engine's message pacing (messages.py) on its own: fake sequences and a fake clock."""

from types import SimpleNamespace

import pytest

from tests.test_text import ByteTokenizer
from worker.engines.detokenizer import OutputText
from worker.engines.native import messages as module
from worker.engines.native.sequence import Outbox
from worker.request import SamplingParams


@pytest.fixture
def clock(monkeypatch):
    """messages.py's monotonic time, a list of one float that the test moves on."""
    now = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    return now


def sequence(index: int, length: int) -> SimpleNamespace:
    """What Messages reads of a Sequence: a stream `index` of `length` tokens, counted in `count`."""
    seq = SimpleNamespace(aborted=False, done=False, logprob=None, prompt_logprobs=None, outbox=Outbox(),
                          stream=index, count=0, request=SimpleNamespace(sampling=SamplingParams(max_tokens=length)),
                          text=OutputText(ByteTokenizer(), [], (), frozenset()))
    seq.at_limit = lambda: seq.count >= length
    return seq


def run_steps(messages: module.Messages, seqs: list, length: int, step_s: float, clock: list[float]) -> list:
    """`length` steps of a token for every sequence, `step_s` apart: each step's (sent, ended)."""
    steps = []
    for step in range(length):
        for seq in seqs:
            seq.count += 1
            seq.done = seq.count == length
        steps.append(messages.of([(seq, [ord("a") + step % 26]) for seq in seqs], len(seqs)))
        clock[0] += step_s
    return steps


def test_the_message_rate_holds_for_the_worker_step_by_step(clock):
    """Streams that started together are all due together every spacing; the rate holds for the
    worker as a whole, so the due messages past what the time since the last step allows wait a
    step and the streams' turns spread out. First and last messages go at once; nothing is lost."""
    streams, rate, step_s, length = 64, 1000.0, 0.01, 40  # spacing: 64 streams / 1000 a second = 64 ms
    steps = run_steps(module.Messages(rate), [sequence(i, length) for i in range(streams)], length, step_s, clock)
    per_step, received = [len(sent) for sent, _ in steps], {i: [] for i in range(streams)}
    for sent, _ in steps:
        for stream, output in sent:
            received[stream].extend(output.token_ids)
    ended = steps[-1][1]
    assert per_step[0] == streams and per_step[-1] == streams, "first and last tokens at once"
    # Between them: rate x step (10) and at most BURST_S of the rate (2) more a step.
    assert max(per_step[1:-1]) <= rate * step_s + rate * module.BURST_S, per_step
    assert sum(per_step[1:-1]) >= streams, "every stream had a message between its first and last"
    assert all(len(tokens) == length for tokens in received.values())
    assert len(ended) == streams


def test_a_streams_messages_keep_the_shortest_interval_however_few_run(clock):
    """server.min_message_interval_s: two streams on 1 ms steps, far under max_messages_per_s,
    still get a message every 5 ms (the tokens between riding in it), their first and last at
    once; with the interval 0, a message a step. Nothing is lost either way."""
    length, step_s = 40, 0.001

    def run(interval):
        received = {0: [], 1: []}
        steps = run_steps(module.Messages(10_000, interval), [sequence(i, length) for i in range(2)], length, step_s,
                          clock)
        for sent, _ in steps:
            for stream, output in sent:
                received[stream].append(output.token_ids)
        return received

    for interval, expected in ((0.005, 1 + -(-(length - 2) // 5) + 1), (0.0, length)):
        for sizes in run(interval).values():
            assert sum(map(len, sizes)) == length, "every token, once"
            assert sizes[0] == [ord("a")] and len(sizes) in (expected, expected - 1), (interval, [len(s) for s in sizes])
            if interval:
                assert max(map(len, sizes)) <= 6, "a message at least every 5 ms: 5 steps' tokens, the last's one more"

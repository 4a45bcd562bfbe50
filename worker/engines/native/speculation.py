"""Speculative decoding without a draft model: a sequence's next tokens guessed by n-gram lookup in
its own tokens (prompt lookup), checked in the step's one forward pass, several accepted a step.

A sequence proposes the tokens that followed the latest earlier occurrence of its last n tokens (n
from ngram_max down to ngram_min). The step computes its last token and the k proposed ones (a row of
1 + k tokens, like a short prefill after the cached context); the logits at position j are the
model's own choice after proposal j - 1. Greedy: proposals are accepted while they equal the argmax,
then the argmax at the first mismatch (or after the last proposal) is added, so the tokens are those
of decoding one at a time. Sampled: rejection sampling of a point-mass proposal (accept d with
probability min(1, p(d)/q(d)) = p(d), else draw from p without d; Leviathan et al., 2023), done by
drawing the position's token as sampling would, with the request's generator, and accepting d when
it is that token: both the acceptance and the rejected case's distribution come out as the rule
says, and every token emitted takes one draw, so a seeded request gives the same tokens with
speculation on and off.

A sequence whose proposals are seldom accepted stops proposing for a while, longer each time, so text
that does not repeat itself runs as plain decoding does. A proposal also has to pay for itself in the
step it joins: its rows cost every sequence of the step time (StepCost, measured), which at batch 1
is next to nothing and on a CPU at batch 8 is most of a decode row's worth each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.config import ConfigError
from worker.engines.sampler import Draws, distribution, inverse_cdf

if TYPE_CHECKING:
    from worker.engines.native.block_manager import BlockManager
    from worker.engines.native.sequence import Sequence
    from worker.request import GenerationRequest

EXPLORE_STEPS = (32, 512)
"""With overlap (CUDA): while launching ahead beats scheduling, a step is scheduled anyway after
this many, so the rate of scheduled steps stays measured: the first interval, doubled after each
such step that leaves launching ahead the faster, up to the second. Each one gives up a step's
overlap and often proposes little (on an H100, SmolLM2 at batch 8: 1.0-2.2 ms for 7 tokens against
0.85 ms launched ahead); every 32 steps, chat ran at 1.03x against 1.09x backing off (bench)."""
PAUSE_STEPS = (8, 512)
"""Steps a sequence proposes nothing after its acceptance fell below the threshold: the first pause,
doubled each time up to the second."""


@dataclass(frozen=True, slots=True)
class Settings:
    num_tokens: int
    """Most tokens proposed a step (k); 0 (speculation off): requests that ask for it are refused."""
    ngram_min: int
    ngram_max: int
    by_default: bool | None
    """Whether requests that do not say speculate; None (auto): on CPUs, not on CUDA (see docs/native.md)."""
    min_accepted: float
    """Accepted tokens a verify step must average (recent steps) for a sequence to keep proposing:
    a verify row of 1 + k tokens costs more than a one-token decode (see docs/native.md)."""

    @classmethod
    def from_args(cls, args: dict) -> Settings:
        mode = {True: "on", False: "off"}.get(args["speculation"], str(args["speculation"]).lower())
        if mode not in ("auto", "on", "requested", "off"):
            raise ConfigError("engine.args.speculation",
                              "auto (on for CPUs) | on (for every request that does not opt out) | requested | off")
        settings = cls(int(args["speculative_tokens"]) if mode != "off" else 0, int(args["speculative_ngram_min"]),
                       int(args["speculative_ngram_max"]), None if mode == "auto" else mode == "on",
                       float(args["speculative_min_accepted"]))
        if not 0 <= settings.num_tokens <= 16:
            raise ConfigError("engine.args.speculative_tokens", "0 (off) to 16 tokens proposed a step")
        if not 1 <= settings.ngram_min <= settings.ngram_max <= 16:
            raise ConfigError("engine.args.speculative_ngram_min", "1 <= speculative_ngram_min <= speculative_ngram_max <= 16")
        if settings.min_accepted < 0:
            raise ConfigError("engine.args.speculative_min_accepted", "a number of tokens, 0 or more")
        return settings


class StepCost:
    """Seconds an all-decode step takes as a + b x rows, fitted to recent steps by least squares with
    exponential forgetting: b is what a proposed token costs the whole step. Unknown (None) until
    the steps seen vary in rows. A step over OUTLIER times the fit's time for its rows counts as
    that: one step that compiled a kernel or waited out a garbage collection (tens of ms, against
    ~0.5 ms for SmolLM2 on an H200) would otherwise price every row for a hundred steps after it,
    and proposals would not pay for that long."""

    OUTLIER = 4.0

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self._sums = [0.0] * 5  # weight, rows, rows^2, seconds, rows x seconds

    def record(self, rows: int, seconds: float) -> None:
        if (fit := self.fit()) is not None and (expected := fit[0] + fit[1] * rows) > 0:
            seconds = min(seconds, self.OUTLIER * expected)
        self._sums = [self.decay * total + value for total, value in
                      zip(self._sums, (1.0, rows, rows * rows, seconds, rows * seconds))]

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds a row; None while the rows seen hardly vary."""
        weight, rows, squares, seconds, products = self._sums
        if weight < 4:
            return None
        variance = squares / weight - (rows / weight) ** 2
        if variance < 0.5:
            return None
        per_row = max(0.0, (products / weight - rows * seconds / weight ** 2) / variance)
        return max(0.0, seconds / weight - per_row * rows / weight), per_row


class Proposer:
    """One sequence's proposals and its recent acceptance."""

    def __init__(self, settings: Settings, prior: float | None = None):
        self.settings = settings
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0  # n-grams that end before this position are in _index
        # Recent accepted tokens a verify step (moving average); a new sequence starts from `prior`,
        # what the engine's proposals have lately added (Speculator.recent), or k.
        self._accepted = float(settings.num_tokens if prior is None else prior)
        # Of the proposed tokens its checks reached, how many were accepted (decayed counts): the
        # rate p at which each next one is, which says what a shorter draft would add.
        self._hits, self._checks = 2 * min(0.9, self._accepted / settings.num_tokens), 2.0
        self._paused = 0
        self._pause = PAUSE_STEPS[0]
        self._source = (0, 1)  # (start, period) of the tokens the last proposal came from
        self._next = 0  # of that source, the index of the token after the last draft launched

    @property
    def active(self) -> bool:
        return not self._paused

    @property
    def expected(self) -> float:
        """Tokens a verify step of this sequence has accepted lately (moving average)."""
        return self._accepted

    def expected_for(self, length: int, full: int) -> float:
        """Tokens a draft cut to `length` of its `full` tokens is expected to add: `expected` scaled
        by p + p^2 + ... + p^length against the same sum to `full`."""
        p = self._hits / self._checks
        if length >= full or p <= 0:
            return self._accepted if length >= full else 0.0
        return self._accepted * (1 - p ** length) / (1 - p ** full) if p < 1 else self._accepted * length / full

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """min(k, limit) tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` found; [] when none is found or the sequence is paused."""
        if self._paused:
            self._paused -= 1
            return []
        start = self._lookup(tokens) if limit > 0 else None
        if start is None:
            return []
        # What followed; where that runs into the suffix itself (a loop of period p), the loop goes
        # on: a model that repeats "a b a b" gets k tokens, not one.
        period = len(tokens) - start
        self._source, self._next = (start, period), min(limit, self.settings.num_tokens)
        return [tokens[start + i % period] for i in range(self._next)]

    def drafted(self, length: int) -> None:
        """The draft launched is the first `length` tokens proposed."""
        self._next = length

    def follow(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` proposals for the step after the last draft launched, as if the model took
        every one of its tokens and then the source's next (a verify step launched before the last
        one is read, ahead.checks): the source's tokens after that one. `tokens`: the
        sequence's, at least those it had when it proposed."""
        start, period = self._source
        first = self._next + 1
        self._next = first + min(limit, self.settings.num_tokens)
        return [tokens[start + i % period] for i in range(first, self._next)]

    def _lookup(self, tokens: list[int]) -> int | None:
        """Where what followed the latest earlier occurrence of the longest suffix found starts."""
        low, high = self.settings.ngram_min, self.settings.ngram_max
        end = len(tokens) - 1  # the suffix ending at `end` is the query, not an earlier occurrence
        index = self._index
        for last in range(max(self._indexed, low - 1), end):
            for n in range(low, min(high, last + 1) + 1):
                index[tuple(tokens[last + 1 - n:last + 1])] = last + 1
        self._indexed = max(self._indexed, end)
        for n in range(min(high, len(tokens)), low - 1, -1):
            if (start := index.get(tuple(tokens[-n:]))) is not None:
                return start
        return None

    def skipped(self, typical: float) -> None:
        """A proposal left out of a step as not worth its rows: the estimate drifts toward what
        proposals typically add lately (`typical`), so a sequence left out after a bad spell is
        checked again where proposals pay, and not where they seldom do."""
        self._accepted += 0.05 * (typical - self._accepted)

    def record(self, accepted: int, proposed: int = 0) -> None:
        """A verify step's outcome (0 of 0: a step it proposed nothing in, which overlap costs
        all the same): below the threshold on average, the sequence pauses."""
        self._accepted = 0.75 * self._accepted + 0.25 * accepted
        if proposed:
            self._hits = 0.75 * self._hits + accepted
            self._checks = 0.75 * self._checks + accepted + (accepted < proposed)
        if self._accepted >= 2 * self.settings.min_accepted:
            self._pause = PAUSE_STEPS[0]
        elif self._accepted < self.settings.min_accepted:
            self._paused, self._pause = self._pause, min(2 * self._pause, PAUSE_STEPS[1])
            self._accepted = 2 * self.settings.min_accepted  # a few tries after the pause


class Speculator:
    """The engine's side: which sequences propose, which proposals join a step, and the counters."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.by_default = bool(settings.by_default)  # the engine settles auto once it knows its device
        self.forget()

    def stats(self) -> tuple[int, int, int]:
        return self.drafts, self.proposed, self.accepted

    def forget(self) -> None:
        """A new speculator's state, counters and what steps taught; the engine calls it after its
        warm-up (warmup.py), whose steps are not the service's and whose times include compiles."""
        self.step_cost = StepCost()
        self.drafts = self.proposed = self.accepted = 0  # rows checked, tokens proposed, tokens accepted
        # Accepted tokens a verify step over every sequence's recent checks (moving average): a new
        # sequence's prior. At batch 8 on a 2-core CPU each proposed row costs ~1/8 of a step, and
        # new sequences starting from k let in proposals of RAG answers that added 1.3 tokens a
        # check (0.93x); with k, rewrites, which add 3.7, kept theirs (1.51x).
        self.recent = float(self.settings.num_tokens)
        # With overlap: tokens a second a sequence gets from decode steps launched ahead (chained)
        # and from those scheduled so that sequences may propose (moving averages).
        self._rates: dict[bool, float | None] = {True: None, False: None}
        self._since_scheduled, self._explore = 0, EXPLORE_STEPS[0]

    def proposer_for(self, request: GenerationRequest, plain: bool) -> Proposer | None:
        """A proposer where the request speculates: asked for (or by default), and its next token
        chosen from the logits alone (no grammar, penalties or logprobs; plain) and no prompt scored."""
        wanted = request.speculative if request.speculative is not None else self.by_default
        if wanted and self.settings.num_tokens and plain and request.prompt_logprobs is None:
            return Proposer(self.settings, self.recent)
        return None

    def propose(self, scheduled: list[tuple[Sequence, int]], blocks: BlockManager, overlap: bool) -> int:
        """Proposals for the decodes in `scheduled` (rewritten to 1 + j tokens) that pay for their
        rows: the tokens a sequence's proposals of j tokens are expected to add (a) against what
        the j rows cost the step (j x b, StepCost), taken while a x (step seconds) > (step tokens)
        x j x b, best first. Each draft is cut to the j that adds the most over its rows' cost,
        p + p^2 + ... + p^j - j x (a row's cost in tokens), p the rate at which the sequence's
        proposed tokens are accepted: at batch 1 on a CPU a row costs ~1/16 of a step and a draft
        that is often accepted pays whole; at batch 8 a row costs most of a decode's worth and the
        last tokens of a draft seldom pay for theirs. Measured on the 2-core EPYC, batch 8: whole
        drafts weighed with their rows at cost ran chat at 0.93x, and with a flat mark-down of a
        token (the rule before this one) at 0.92-0.97x and rewrites at 1.51-1.62x a round; cut, chat
        at 0.99-1.04x and rewrites at 1.45-1.60x. Only where free blocks hold them, after every
        decode has its block: proposals never preempt. Returns the tokens added."""
        fit = self.step_cost.fit()
        tokens, seconds = len(scheduled), fit[0] + fit[1] * len(scheduled) if fit else 0.0
        row_cost = tokens * fit[1] / seconds if fit and seconds > 0 else 0.0  # a row, in the step's tokens
        candidates = []
        for row, (seq, _) in enumerate(scheduled):
            if seq.proposer is None:
                continue
            limit = seq.end - len(seq.tokens) - 1  # the token after them counts too
            if draft := seq.proposer.propose(seq.tokens, limit):
                proposer, full = seq.proposer, len(draft)
                adds = [proposer.expected_for(j, full) for j in range(1, full + 1)]
                length = max(range(1, full + 1), key=lambda j: adds[j - 1] - j * row_cost)
                candidates.append((adds[length - 1] / length, row, draft[:length]))
            elif overlap:  # a step that proposes nothing still costs the overlap (ahead.decodes)
                seq.proposer.record(0)
        added, paying = 0, True
        for per_token, row, draft in sorted(candidates, reverse=True):
            seq = scheduled[row][0]
            paying = paying and per_token > 0 and not (fit and per_token * seconds <= tokens * fit[1])
            if not paying:  # this one and the rest (worse) would cost the step more than they add
                seq.proposer.skipped(self.recent)
                # Checks are what move `recent`: while none pays it creeps back toward k, so text
                # that turns to copying is tried again however long the bad spell was.
                self.recent += 0.0005 * (self.settings.num_tokens - self.recent)
                continue
            if blocks.can_grow(seq.blocks, seq.num_cached + 1 + len(draft)):
                blocks.grow(seq.blocks, seq.num_cached + 1 + len(draft))
                seq.draft = draft
                seq.proposer.drafted(len(draft))
                scheduled[row] = (seq, 1 + len(draft))
                added += len(draft)
                if fit:
                    tokens, seconds = tokens + per_token * len(draft), seconds + fit[1] * len(draft)
        return added

    def record_period(self, chained: bool, tokens: int, seqs: int, seconds: float) -> None:
        """A decode step read `seconds` after the step before it (with overlap): launched ahead or
        scheduled, the tokens it gave its sequences."""
        if seqs and seconds > 0:
            rate, old = tokens / seqs / seconds, self._rates[chained]
            self._rates[chained] = rate if old is None else 0.8 * old + 0.2 * rate

    def schedules_next(self) -> bool:
        """Whether a decode step whose sequences may propose is scheduled rather than launched ahead
        of its predecessor's tokens (proposals need them): when scheduled steps have lately given
        more tokens a second than launching ahead does, while either is unmeasured, and once the
        exploration interval (EXPLORE_STEPS) has passed."""
        chained, scheduled = self._rates[True], self._rates[False]
        self._since_scheduled += 1
        if chained is None or scheduled is None or scheduled > chained:
            self._since_scheduled, self._explore = 0, EXPLORE_STEPS[0]
            return True
        if self._since_scheduled >= self._explore:  # exploring: the last exploration did not win
            self._since_scheduled, self._explore = 0, min(2 * self._explore, EXPLORE_STEPS[1])
            return True
        return False

    def check(self, seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor,
              chosen: list[int] | None = None, standing: list[bool] | None = None) -> list[tuple[Sequence, list[int]]]:
        """(sequence, the tokens it appends) for the rows with proposals of a step just read (verify
        takes the arguments it shares), the counters and their proposers told. Left out: the rows
        not `standing` (Step.standing; by default, those of ended sequences)."""
        checked = []
        standing = standing if standing is not None else [not seq.done for seq in seqs]
        for seq, draft, tokens, stands in zip(seqs, drafts, verify(logits, seqs, drafts, chosen), standing):
            if not stands:
                continue
            if draft:  # (a run of a check launched ahead may have none: the token after a rejection)
                self.drafts, self.proposed, self.accepted = self.drafts + 1, self.proposed + len(draft), \
                    self.accepted + len(tokens) - 1
                seq.proposer.record(len(tokens) - 1, len(draft))
                self.recent = 0.98 * self.recent + 0.02 * (len(tokens) - 1)
            checked.append((seq, tokens))
        return checked


def verify(logits: torch.Tensor, rows: list, drafts: list[list[int]], chosen: list[int] | None = None) -> list[list[int]]:
    """The tokens each row's sequence appends: its accepted proposals, then one token more.
    logits: (sum of 1 + len(draft), vocab), each row's positions in order; rows: sequences
    (request, generator) with no grammar, penalties or logprobs; drafts: each row's proposals;
    chosen: the argmax of every logits row, on the host already (a step's copy, Step.check)."""
    starts, at = [], 0
    for draft in drafts:
        starts.append(at)
        at += 1 + len(draft)
    out: list[list[int]] = [[] for _ in rows]
    greedy = [i for i, row in enumerate(rows) if row.request.sampling.is_greedy]
    if greedy and chosen is None:
        index = [starts[i] + j for i in greedy for j in range(1 + len(drafts[i]))]
        picked = (logits[index] if len(index) < len(logits) else logits).float().argmax(dim=-1).tolist()
        chosen = [0] * at
        for row, token in zip(index, picked):
            chosen[row] = token
    for i in greedy:
        draft, targets = drafts[i], chosen[starts[i]:starts[i] + 1 + len(drafts[i])]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == targets[accepted]:
            accepted += 1
        out[i] = [*draft[:accepted], targets[accepted]]
    for i, row in enumerate(rows):
        if not row.request.sampling.is_greedy:
            span = logits[starts[i]:starts[i] + 1 + len(drafts[i])]
            out[i] = _sampled(*distribution(span, row.request.sampling), drafts[i], row.generator)
    return out


def _sampled(probs: torch.Tensor, order: torch.Tensor | None, draft: list[int], generator: Draws) -> list[int]:
    """Position by position, the token sampling draws there (one number from the request's
    generator, as sample() draws it); a proposal is accepted when it is that token, and the first
    that is not ends the row with the token drawn. So a proposal is accepted with its probability
    p(d), a rejection leaves p without d, and the tokens are those sampling one at a time gives,
    draw for draw."""
    tokens = []
    for j in range(len(draft) + 1):
        rank = int(inverse_cdf(probs[j:j + 1], [generator])[0])
        tokens.append(int(order[j, rank]) if order is not None else rank)
        if j == len(draft) or tokens[-1] != draft[j]:
            return tokens
    return tokens

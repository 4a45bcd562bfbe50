"""PrefillPacer: sizes prefill chunks by time, so no step behind a long prompt runs for seconds.

A step is what an abort, a deadline or another stream's next token waits for. With a fixed token
budget a step's time grows with the context its chunk attends to: on the 2-core CPU a 2048-token
chunk of SmolLM2 took 2.1 s at the start of a prompt and 12.7 s at offset 2048. The pacer prices a
step's Work in FLOPs (the linear layers per token, attention per (query, key) pair), learns how
fast the engine computes each on steps that prefill, and cuts each chunk so the step's predicted
time stays within `target_s`.

The rate is the fastest of the last RECENT measured steps. A step is never faster than the device
computes, but often slower: the first prefill of a shape compiles Triton kernels (0.5-1.2 s on an
H100 host), and a short chunk on a GPU is bound by the host's launches (~7 ms for the Llama-1B
shape whatever its size). A moving average took those in and cut later prompts into chunks that
each paid the launches: on an H100 SmolLM2's shape took 110 ms to the first token of a 200-token
prompt and 0.7 s of a 1,000-token one, against 13 and 15 ms in one step.

Attention's FLOPs cost more time than the linear layers' where its kernels run slower (a CPU's,
most at short chunks over long contexts), so a pair FLOP weighs `weight` linear ones, the weight
that fits the recent steps best (WEIGHTS). Priced alike, a synthetic device whose pairs take 2.5
times a linear FLOP's time ran a long prompt's 0.25-s chunks at up to 0.46 s (tests/test_long_prompts.py);
SmolLM2 on 2 cores, where the weights learned came to 1.2-4, a 7,800-token prompt's chunks ran at
1.12 times the target at the median against 1.17-1.19 (bench/prefill_pacing.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from worker.engines.native.model import ModelConfig

MIN_CHUNK = 16
"""Tokens a prefill gets per step however slow the step: a long prompt still moves."""
RECENT = 16
MEASURED_TOKENS = MIN_CHUNK
"""Steps that prefill fewer tokens say too little of the prefill rate to be measured. No more than
MIN_CHUNK: a rate measured far too low once (the first prefill, compiling its Triton kernels for
~0.9 s on an H100) cuts chunks to MIN_CHUNK, and at 32 those were never measured again: every
later prompt went 16 tokens a step, a 1,000-token one in 63 steps (0.7 s of TTFT against 12 ms
of forward passes, SmolLM2's shape)."""
WEIGHTS = 2.0 ** (np.arange(-4, 13) / 4)
"""What an attention pair FLOP may weigh in linear ones: 0.5-8 in steps of 2^(1/4). The one kept
predicts the recent steps best at the fastest rate: the least mean overrun of their times over
their predictions, each counted up to OVERRUN_CAP, so that a slow step (a compile) counts as much
whatever the weight. Of weights within FIT_SLACK of the best, the one nearest the weight before:
steps alike in their share of attention say little of its weight."""
OVERRUN_CAP = 0.5
FIT_SLACK = 0.01


@dataclass(frozen=True)
class Work:
    """A step's priced work: FLOPs of its linear layers, and of attention's (query, key) pairs."""

    linear: float = 0.0
    pairs: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.linear + other.linear, self.pairs + other.pairs)

    def __mul__(self, times: float) -> Work:
        return Work(self.linear * times, self.pairs * times)

    __rmul__ = __mul__

    def __bool__(self) -> bool:
        return bool(self.linear or self.pairs)


class PrefillPacer:
    def __init__(self, config: ModelConfig, target_s: float):
        q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        linear_params = config.num_layers * (config.hidden_size * (2 * q_width + 2 * kv_width)
                                             + 3 * config.hidden_size * config.intermediate_size)
        self.token_flops = 2.0 * linear_params
        # q.k and p.v, each a multiply and an add per head dimension, in every layer
        self.pair_flops = 4.0 * config.num_layers * config.num_heads * config.head_dim
        self.target_s = target_s
        self.weight = 1.0  # an attention pair FLOP in linear ones
        self.rate: float | None = None  # weighted FLOP/s: the fastest recent step's; None until one is measured
        self._measured: deque[tuple[Work, float]] = deque(maxlen=RECENT)  # (work, seconds) of recent prefills

    def work(self, tokens: int, cached: int) -> Work:
        """`tokens` new tokens of a sequence after `cached` ones: each attends to the cached ones and
        to the new ones up to itself."""
        return self.work_of(((tokens, cached),))

    def work_of(self, rows: Iterable[tuple[int, int]]) -> Work:
        """work() of (tokens, cached) rows together, summed as floats: a step's decodes (256 rows
        priced one Work at a time took 360 us of the engine thread, against 40)."""
        tokens = pairs = 0.0
        for count, cached in rows:
            tokens += count
            pairs += count * (cached + (count + 1) / 2)
        return Work(tokens * self.token_flops, pairs * self.pair_flops)

    def priced(self, work: Work) -> float:
        """`work` in linear FLOPs."""
        return work.linear + self.weight * work.pairs

    def chunk(self, cached: int, remaining: int, budget_tokens: int, step: Work, first: bool = True) -> int:
        """Tokens of a prompt with `cached` tokens in the cache and `remaining` to go that the
        step can take, given the work already in it and its token budget. Only a step's `first`
        prompt chunk gets MIN_CHUNK whatever the time; a later one only what fits, maybe 0 (with
        MIN_CHUNK for each, any number of prompts of up to 16 tokens that arrived together joined
        one step, whatever the target)."""
        limit = min(remaining, budget_tokens)
        if not self.target_s or self.rate is None:
            return limit
        allowed = self.target_s * self.rate - self.priced(step)
        # the largest n with priced(work(n, cached)) <= allowed: a n^2 + b n - allowed <= 0
        pair = self.weight * self.pair_flops
        a = pair / 2
        b = self.token_flops + pair * (cached + 0.5)
        n = int((-b + math.sqrt(b * b + 4 * a * max(allowed, 0.0))) / (2 * a))
        return min(limit, max(n, MIN_CHUNK if first else 0))

    def record(self, work: Work, seconds: float, prefill_tokens: int) -> None:
        """A finished step: its priced work, how long it took and how many prompt tokens it computed
        (decode-only steps run at another rate and are not counted)."""
        if prefill_tokens < MEASURED_TOKENS or seconds <= 0:
            return
        self._measured.append((work, seconds))
        linear, pairs, times = np.array([(w.linear, w.pairs, s) for w, s in self._measured]).T
        priced = linear + WEIGHTS[:, None] * pairs  # (weights, steps)
        rates = (priced / times).max(axis=1)  # each weight's fastest step
        overrun = np.minimum(times * rates[:, None] / priced - 1, OVERRUN_CAP).mean(axis=1)
        near = np.flatnonzero(overrun <= overrun.min() + FIT_SLACK)
        chosen = near[np.abs(np.log(WEIGHTS[near] / self.weight)).argmin()]
        self.weight, self.rate = float(WEIGHTS[chosen]), float(rates[chosen])

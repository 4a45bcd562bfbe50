"""PrefillPacer: sizes prefill chunks by time, so no step behind a long prompt runs for seconds.

A step is what an abort, a deadline or another stream's next token waits for. With a fixed token
budget a step's time grows with the context its chunk attends to: on the 2-core CPU a 2048-token
chunk of SmolLM2 took 2.1 s at the start of a prompt and 12.7 s at offset 2048. The pacer prices a
step in FLOPs (the linear layers per token, attention per (query, key) pair), measures the rate
the engine reaches on steps that prefill, and cuts each chunk so the step's FLOPs at that rate
stay within `target_s`.

The rate is the fastest of the last RECENT measured steps. A step is never faster than the device
computes, but often slower: the first prefill of a shape compiles Triton kernels (0.5-1.2 s on an
H100 host), and a short chunk on a GPU is bound by the host's launches (~7 ms for the Llama-1B
shape whatever its size). A moving average took those in and cut later prompts into chunks that
each paid the launches: on an H100 SmolLM2's shape took 110 ms to the first token of a 200-token
prompt and 0.7 s of a 1,000-token one, against 13 and 15 ms in one step.
"""

from __future__ import annotations

import math
from collections import deque

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


class PrefillPacer:
    def __init__(self, config: ModelConfig, target_s: float):
        q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        linear_params = config.num_layers * (config.hidden_size * (2 * q_width + 2 * kv_width)
                                             + 3 * config.hidden_size * config.intermediate_size)
        self.token_flops = 2.0 * linear_params
        # q.k and p.v, each a multiply and an add per head dimension, in every layer
        self.pair_flops = 4.0 * config.num_layers * config.num_heads * config.head_dim
        self.target_s = target_s
        self._measured: deque[float] = deque(maxlen=RECENT)  # FLOP/s of recent prefill steps

    def cost(self, tokens: int, cached: int) -> float:
        """FLOPs of `tokens` new tokens of a sequence after `cached` ones: each attends to the
        cached ones and to the new ones up to itself."""
        return tokens * (self.token_flops + self.pair_flops * (cached + (tokens + 1) / 2))

    def chunk(self, cached: int, remaining: int, budget_tokens: int, step_flops: float, first: bool = True) -> int:
        """Tokens of a prompt with `cached` tokens in the cache and `remaining` to go that the
        step can take, given the FLOPs already in it and its token budget. Only a step's `first`
        prompt chunk gets MIN_CHUNK whatever the time; a later one only what fits, maybe 0 (with
        MIN_CHUNK for each, any number of prompts of up to 16 tokens that arrived together joined
        one step, whatever the target)."""
        limit = min(remaining, budget_tokens)
        if not self.target_s or not self._measured:
            return limit
        allowed = self.target_s * self.rate - step_flops
        # the largest n with cost(n, cached) <= allowed: a n^2 + b n - allowed <= 0
        a = self.pair_flops / 2
        b = self.token_flops + self.pair_flops * (cached + 0.5)
        n = int((-b + math.sqrt(b * b + 4 * a * max(allowed, 0.0))) / (2 * a))
        return min(limit, max(n, MIN_CHUNK if first else 0))

    def record(self, flops: float, seconds: float, prefill_tokens: int) -> None:
        """A finished step: its priced FLOPs, how long it took and how many prompt tokens it
        computed (decode-only steps run at another rate and are not counted)."""
        if prefill_tokens >= MEASURED_TOKENS and seconds > 0:
            self._measured.append(flops / seconds)

    @property
    def rate(self) -> float | None:
        """FLOP/s the steps reach: the fastest recent one's; None until a step is measured."""
        return max(self._measured, default=None)

"""PrefillPacer: sizes prefill chunks by time, so no step behind a long prompt runs for seconds.

A step is what an abort, a deadline or another stream's next token waits for. With a fixed token
budget a step's time grows with the context its chunk attends to: on the 2-core CPU a 2048-token
chunk of SmolLM2 took 2.1 s at the start of a prompt and 12.7 s at offset 2048. The pacer prices a
step in FLOPs (the linear layers per token, attention per (query, key) pair), measures the rate
the engine reaches on steps that prefill, and cuts each chunk so the step's FLOPs at that rate
stay within `target_s`.
"""

from __future__ import annotations

import math

from worker.engines.native.model import ModelConfig

MIN_CHUNK = 16
"""Tokens a prefill gets per step however slow the step: a long prompt still moves."""
MEASURED_TOKENS = 32
"""Steps that prefill fewer tokens say too little of the prefill rate to be measured."""


class PrefillPacer:
    def __init__(self, config: ModelConfig, target_s: float):
        q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        linear_params = config.num_layers * (config.hidden_size * (2 * q_width + 2 * kv_width)
                                             + 3 * config.hidden_size * config.intermediate_size)
        self.token_flops = 2.0 * linear_params
        # q.k and p.v, each a multiply and an add per head dimension, in every layer
        self.pair_flops = 4.0 * config.num_layers * config.num_heads * config.head_dim
        self.target_s = target_s
        self.rate: float | None = None
        """FLOP/s measured on recent prefill steps; None until the first one."""

    def cost(self, tokens: int, cached: int) -> float:
        """FLOPs of `tokens` new tokens of a sequence after `cached` ones: each attends to the
        cached ones and to the new ones up to itself."""
        return tokens * (self.token_flops + self.pair_flops * (cached + (tokens + 1) / 2))

    def chunk(self, cached: int, remaining: int, budget_tokens: int, step_flops: float) -> int:
        """Tokens of a prompt with `cached` tokens in the cache and `remaining` to go that the
        step can take, given the FLOPs already in it and its token budget."""
        limit = min(remaining, budget_tokens)
        if not self.target_s or self.rate is None:
            return limit
        allowed = self.target_s * self.rate - step_flops
        # the largest n with cost(n, cached) <= allowed: a n^2 + b n - allowed <= 0
        a = self.pair_flops / 2
        b = self.token_flops + self.pair_flops * (cached + 0.5)
        n = int((-b + math.sqrt(b * b + 4 * a * max(allowed, 0.0))) / (2 * a))
        return min(limit, max(n, MIN_CHUNK))

    def record(self, flops: float, seconds: float, prefill_tokens: int) -> None:
        """A finished step: its priced FLOPs, how long it took and how many prompt tokens it
        computed (decode-only steps run at another rate and are not counted)."""
        if prefill_tokens < MEASURED_TOKENS or seconds <= 0:
            return
        measured = flops / seconds
        self.rate = measured if self.rate is None else 0.7 * self.rate + 0.3 * measured

"""Continuous batching for the native engine: which sequences run in the next step, and how many
tokens each.

Running sequences decode one token each (and their proposals, speculation.py), then waiting ones
prefill in chunks under the step's token budget and the PrefillPacer, oldest first. When the cache
cannot hold a running sequence's next token, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed (through the prefix cache
where its blocks survive).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable

from worker.engines.native.block_manager import BlockManager
from worker.engines.native.pacer import PrefillPacer, Work
from worker.engines.native.sequence import Sequence
from worker.engines.native.speculation import Speculator


class Batcher:
    def __init__(self, blocks: BlockManager, pacer: PrefillPacer, speculator: Speculator, max_batched_tokens: int,
                 max_num_seqs: int, overlap: bool, on_preempt: Callable[[Sequence], None]):
        self.blocks, self.pacer, self.speculator = blocks, pacer, speculator
        self.max_batched_tokens, self.max_num_seqs, self.overlap = max_batched_tokens, max_num_seqs, overlap
        self.on_preempt = on_preempt  # before its blocks go: a preempted sequence sends what it holds
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0
        self.step_work = Work()  # of the step last scheduled, priced by the PrefillPacer

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def drop(self, seq: Sequence) -> None:
        """`seq` is done (ended or aborted): its blocks go back."""
        seq.done = True
        self.blocks.release(seq.blocks)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens this step): a decode for each running one (and their proposals, unless a
        prompt joins on CUDA), then prefill chunks within the budget and pacer."""
        budget = self.max_batched_tokens
        self.step_work = Work()
        scheduled: list[tuple[Sequence, int]] = []
        preempted: set[int] = set()
        for seq in list(self.running):
            if id(seq) in preempted:
                continue  # preempted below to make room for an older one
            while not self.blocks.can_grow(seq.blocks, seq.num_cached + 1):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(id(victim))
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq.blocks, seq.num_cached + 1)
                scheduled.append((seq, 1))
                budget -= 1
        joins = bool(self.waiting) and len(self.running) < self.max_num_seqs  # a prompt chunk may join
        # With overlap (CUDA) a prompt let in joins as graph rows beside the decodes; with every
        # draft verified too, the step outgrew the graphs and ran eager (H100, rewrites at batch 8:
        # 4-14 ms such a step against 1.4-2.4 without the drafts, 0.72x against 1.17x in all).
        if self.speculator.settings.num_tokens and not (self.overlap and joins):
            budget -= self.speculator.propose(scheduled, self.blocks, self.overlap)
        if joins:  # price the decodes
            self.step_work = self.pacer.work_of((count, seq.num_cached) for seq, count in scheduled)
        self._admit(scheduled, budget)
        return scheduled

    def ahead(self, seqs: list[Sequence], rows: int, fits: Callable[[Sequence, int], bool]) -> list[tuple[Sequence, int]] | None:
        """The (sequence, tokens) rows of the step after the one running, for `seqs` of its rows, each
        sampling a token still on the device (ahead.decodes): a decode of that token each,
        then whole prompts waiting that `fits` takes (sequence.DecodeRows), oldest first, within
        `rows` rows in all. None when that step is not known yet: the blocks cannot hold the
        pending tokens, the oldest waiting prompt cannot join so (a long one, one scored for
        prompt logprobs), or the prompts left waiting would fill more than another such step: a
        step on the host takes them in chunks of up to max_batched_tokens, which a burst needs (256
        prompts of 128 tokens joined two a step took 224 ms to their first tokens on an H200, 124 ms
        as chunks)."""
        growing = []  # one pass over the rows: at batch 256 the engine thread is the bottleneck
        for seq in seqs:
            if len(seq.tokens) >= len(seq.blocks.blocks) * self.blocks.block_size:
                growing.append(seq)
        if len(growing) > self.blocks.num_free:
            return None
        for seq in growing:
            self.blocks.grow(seq.blocks, len(seq.tokens) + 1)
        scheduled = [(seq, 1) for seq in seqs]
        if not self.waiting:
            return scheduled
        counters = self.prefix_queried_tokens, self.prefix_hit_tokens, self.step_work
        partial = bool(self.waiting[0].blocks)  # a prompt part computed (chunked): only the oldest can be
        if self._admit(scheduled, min(self.max_batched_tokens, rows) - len(seqs), fits):
            return scheduled  # every prompt that a slot and the blocks allow joined
        joined = scheduled[len(seqs):]
        if joined and (partial or not self._waiting_over(rows)):
            return scheduled
        # Back to the queue as they were: nothing of theirs was computed, and their blocks had no names.
        del self.running[len(self.running) - len(joined):]
        for seq, _ in reversed(joined):
            self.blocks.release(seq.blocks)
            seq.num_cached = 0
            self.waiting.appendleft(seq)
        self.prefix_queried_tokens, self.prefix_hit_tokens, self.step_work = counters
        return None

    def _waiting_over(self, tokens: int) -> bool:
        """Whether the prompts that free slots could take hold more than `tokens` tokens to compute
        (their cached prefixes not known yet, so counted)."""
        for seq in itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.running))):
            tokens -= len(seq.tokens) - seq.num_cached
            if tokens < 0:
                return True
        return False

    def _admit(self, scheduled: list[tuple[Sequence, int]], budget: int,
               whole: Callable[[Sequence, int], bool] | None = None) -> bool:
        """Prefill chunks of waiting sequences into `scheduled`, oldest first, within `budget` tokens
        and the pacer; with `whole`, only whole prompts that it takes. False when the oldest one
        was refused by `whole` or the budget (not for want of blocks or slots)."""
        first = True  # the step's first prompt chunk: the pacer gives it MIN_CHUNK at least
        while self.waiting and len(self.running) < self.max_num_seqs:
            if budget <= 0:
                return whole is None
            seq = self.waiting[0]
            starting = not seq.blocks
            if starting:  # a prompt being scored needs every position's logits: none from the cache
                seq.num_cached, queried = (0, 0) if seq.scores_prompt else self.blocks.match_prefix(seq.blocks, seq.tokens)
            left = len(seq.tokens) - seq.num_cached
            if whole is None:
                # 0 when the step is full by the pacer's time: the prompt waits, as for want of blocks
                chunk, refused = self.pacer.chunk(seq.num_cached, left, budget, self.step_work, first), False
            else:
                chunk = left
                refused = seq.scores_prompt or chunk > budget or not whole(seq, chunk)
            if refused or not chunk or not self.blocks.can_grow(seq.blocks, seq.num_cached + chunk):
                if starting:  # a waiting sequence holds no blocks until it runs
                    self.blocks.release(seq.blocks)
                    seq.num_cached = 0
                return not refused
            if starting:
                self.prefix_queried_tokens += queried
                self.prefix_hit_tokens += seq.num_cached
            self.blocks.grow(seq.blocks, seq.num_cached + chunk)
            scheduled.append((seq, chunk))
            budget, first = budget - chunk, False
            self.step_work += self.pacer.work(chunk, seq.num_cached)
            if seq.num_cached + chunk == len(seq.tokens):
                self.running.append(self.waiting.popleft())
            else:
                break  # a chunked prefill goes on next step
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.on_preempt(seq)
        self.blocks.release(seq.blocks)
        seq.num_cached = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)

"""Synthetic engine: deterministic tokens at a set aggregate rate, for tests and transport benchmarks.

It runs no model. Prompts are split into words (one token each); every output token is one
lowercase letter derived from the seed and position. Never a default: it is chosen by name only.
With a prefill cost and a prefix cache it stands in for a model's workers in routing benchmarks:
a prompt's cached blocks cost nothing, its others prefill_tokens_per_s, and the cache publishes
the same events, named the same way, as the native engine's.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

from worker.config import ConfigError
from worker.engines.base import BaseEngine, ModelInfo, RequestStream
from worker.engines.cache_events import CacheEvents, prompt_hashes
from worker.engines.detokenizer import StopStrings
from worker.request import GenerationRequest, RequestOutput

MIN_STEP_S = 0.001


@dataclass
class SyntheticArgs:
    tokens_per_s: float = 2000.0
    """Aggregate output rate over all running requests (a batched engine's throughput)."""
    budget_tokens: int = 1_000_000
    max_model_len: int = 8192
    vocab_size: int = 32000
    prefill_tokens_per_s: float = 0.0
    """When set, the first token of a request waits its uncached prompt tokens / this."""
    prefill_lanes: int = 0
    """0: every request prefills at once, each at prefill_tokens_per_s; N: at most N prefills at a
    time, the rest wait their turn (a compute-bound device is 1)."""
    prefix_cache_blocks: int = 0
    """When set, a prefix cache of this many blocks of prompt tokens, least recently used evicted,
    published as cache events (WorkerControl.CacheEvents)."""
    block_size: int = 16
    stall_after_tokens: int = 0
    """Fault injection: after this many tokens in all, the engine stops producing (a hung device)."""
    fail_after_tokens: int = 0
    """Fault injection: after this many tokens in all, the engine's loop raises (a dead engine)."""
    step_ms: float = 0.0
    """When set, a batched decode: every step_ms each running request gets exactly one token
    (tokens_per_s is then unused). Requests admitted in the same step stay in lockstep."""

    @classmethod
    def from_mapping(cls, args: dict) -> SyntheticArgs:
        known = set(cls.__dataclass_fields__)
        for key in args:
            if key not in known:
                raise ConfigError(f"engine.args.{key}", f"unknown synthetic engine argument; expected {sorted(known)}")
        try:
            parsed = cls(**{k: type(getattr(cls, k))(v) for k, v in args.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError("engine.args", f"synthetic engine: {exc}") from None
        if parsed.step_ms < 0:
            raise ConfigError("engine.args.step_ms", "must be 0 (off) or positive")
        if parsed.tokens_per_s <= 0:
            raise ConfigError("engine.args.tokens_per_s", "must be positive")
        if parsed.vocab_size < 30 or parsed.max_model_len < 2 or parsed.budget_tokens < 1:
            raise ConfigError("engine.args", "vocab_size >= 30, max_model_len >= 2 and budget_tokens >= 1")
        if parsed.prefill_lanes < 0 or parsed.prefix_cache_blocks < 0 or parsed.block_size < 1:
            raise ConfigError("engine.args", "prefill_lanes >= 0, prefix_cache_blocks >= 0 and block_size >= 1")
        return parsed


@dataclass(slots=True)
class _Sequence:
    request: GenerationRequest
    stream: RequestStream
    base: int
    ready_at: float
    generated: int = 0
    stops: StopStrings | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)


class _PrefixCache:
    """Prompt blocks named as the native engine names them (cache_events.py), the least recently
    used evicted first. A prompt's blocks are touched last to first, so a chain loses its tail
    before its head."""

    def __init__(self, capacity: int, events: CacheEvents):
        self.capacity = capacity
        self.events = events
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queried = self.hits = 0  # prompt tokens looked up, and found

    def take(self, tokens: list[int]) -> int:
        """Caches `tokens`' full blocks; returns how many leading tokens were cached already."""
        size = self.events.block_size
        hashes = prompt_hashes(tokens, size)
        held = next((i for i, digest in enumerate(hashes) if digest not in self._blocks), len(hashes))
        changes: list[tuple] = []
        for index in reversed(range(len(hashes))):
            digest = hashes[index]
            if digest not in self._blocks:
                parent = hashes[index - 1] if index else b""
                changes.append(("stored", digest, parent, tokens[index * size:(index + 1) * size]))
            self._blocks[digest] = None
            self._blocks.move_to_end(digest)
        while len(self._blocks) > self.capacity:
            changes.append(("removed", self._blocks.popitem(last=False)[0]))
        self.events.publish(changes)
        self.queried += len(hashes) * size
        self.hits += held * size
        return held * size


class SyntheticEngine(BaseEngine):
    name = "synthetic"
    # It runs no model: there are no logits to take logprobs from or to mask, and no template.
    reports_logprobs = False
    renders_tools = False

    def __init__(self, config, on_fatal=None):
        super().__init__(config, on_fatal)
        self.args = SyntheticArgs.from_mapping(config.engine.args)
        self._running: dict[int, _Sequence] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._rotation = 0
        self._emitted = 0
        self._lanes = [0.0] * self.args.prefill_lanes  # when each prefill lane is next free
        self._cache: _PrefixCache | None = None
        if self.args.prefix_cache_blocks:
            self.events = CacheEvents(self.args.block_size)
            self._cache = _PrefixCache(self.args.prefix_cache_blocks, self.events)

    async def load_model(self) -> ModelInfo:
        self.info = ModelInfo(
            served_name=self.config.engine.served_name or "synthetic",
            max_model_len=self.config.engine.max_model_len or self.args.max_model_len,
            vocab_size=self.args.vocab_size,
            kv_bytes_per_token=0,
        )
        self._task = asyncio.create_task(self._loop(), name="synthetic-engine")
        self._task.add_done_callback(self._on_loop_exit)
        return self.info

    async def unload_model(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for sequence in self._running.values():
            sequence.stream.put(RequestOutput(finish_reason="aborted"))
        self._running.clear()

    def kv_budget_tokens(self) -> int:
        return self.args.budget_tokens

    def num_unfinished(self) -> int:
        return len(self._running)

    def prefix_cache_stats(self) -> tuple[int, int] | None:
        return (self._cache.queried, self._cache.hits) if self._cache else None

    def encode(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        text = request.prompt if request.prompt is not None else "\n".join(
            f"{m.role}: {m.content}" for m in request.messages) + "\nassistant:"
        vocab = self.args.vocab_size
        return [zlib.crc32(word.encode()) % vocab for word in text.split()] or [0]

    def stream_predict(self, request: GenerationRequest) -> RequestStream:
        stream = self.make_stream(request.request_id)
        seed = request.sampling.seed if request.sampling.seed is not None else zlib.crc32(
            bytes(str(request.prompt_token_ids), "ascii"))
        ids = request.prompt_token_ids
        uncached = len(ids) - (self._cache.take(ids) if self._cache else 0)
        start = asyncio.get_running_loop().time()
        delay = uncached / self.args.prefill_tokens_per_s if self.args.prefill_tokens_per_s else 0.0
        if self._lanes:
            lane = min(range(len(self._lanes)), key=self._lanes.__getitem__)
            start = self._lanes[lane] = max(start, self._lanes[lane])
            self._lanes[lane] += delay
        self._running[id(stream)] = _Sequence(
            request, stream, base=seed, ready_at=start + delay,
            stops=StopStrings(request.sampling.stop) if request.sampling.stop else None,
            stop_ids=frozenset(request.sampling.stop_token_ids))
        self._wakeup.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        if self._running.pop(id(stream), None) is not None:
            stream.put(RequestOutput(finish_reason="aborted"))

    async def _loop(self) -> None:
        if self.args.step_ms:
            await self._lockstep_loop()
        else:
            await self._rate_loop()

    async def _lockstep_loop(self) -> None:
        loop = asyncio.get_running_loop()
        step_s = self.args.step_ms / 1000
        next_step = loop.time()
        while True:
            if not self._running:
                self._wakeup.clear()
                await self._wakeup.wait()
                next_step = loop.time()
            next_step += step_s
            await asyncio.sleep(max(0.0, next_step - loop.time()))
            now = loop.time()
            self._prefill_step(now)
            for sequence in [s for s in self._running.values() if s.ready_at <= now]:
                self._emit(sequence, 1)

    async def _rate_loop(self) -> None:
        loop = asyncio.get_running_loop()
        credit = 0.0
        last = loop.time()
        while True:
            if not self._running:
                self._wakeup.clear()
                await self._wakeup.wait()
                last = loop.time()
            await asyncio.sleep(MIN_STEP_S)
            now = loop.time()
            # Tokens earned since the last step, shared round-robin; capped so an idle gap is no burst.
            credit = min(credit + (now - last) * self.args.tokens_per_s, self.args.tokens_per_s * 0.05)
            last = now
            self._prefill_step(now)
            ready = [s for s in self._running.values() if s.ready_at <= now]
            if not ready or credit < 1:
                continue
            tokens = int(credit)
            credit -= tokens
            share, extra = divmod(tokens, len(ready))
            start = self._rotation % len(ready)
            self._rotation += 1
            for index, sequence in enumerate(ready):
                count = share + (1 if (index - start) % len(ready) < extra else 0)
                if count:
                    self._emit(sequence, count)

    def _stalled(self) -> bool:
        return bool(self.args.stall_after_tokens) and self._emitted >= self.args.stall_after_tokens

    def _prefill_step(self, now: float) -> None:
        """A request still in its prefill delay is work in progress, as a model's prefill chunks are.
        Not scanned again within 0.5 s of the last step: this runs every 1 ms tick, and the
        watchdog reading it counts seconds."""
        if time.monotonic() - self.last_step_at < 0.5:
            return
        if not self._stalled() and any(s.ready_at > now for s in self._running.values()):
            self.last_step_at = time.monotonic()

    def _emit(self, sequence: _Sequence, count: int) -> None:
        if self.args.fail_after_tokens and self._emitted >= self.args.fail_after_tokens:
            raise RuntimeError("injected engine fault")
        if self.args.stall_after_tokens:
            count = min(count, self.args.stall_after_tokens - self._emitted)
            if count <= 0:
                return
        self._emitted += count
        self.last_step_at = time.monotonic()
        request = sequence.request
        count = min(count, request.sampling.max_tokens - sequence.generated)
        vocab = self.args.vocab_size
        first = sequence.generated
        ids = [(sequence.base + 7919 * (first + i)) % vocab for i in range(count)]
        finish = None
        if sequence.stop_ids:
            for i, token in enumerate(ids):
                if token in sequence.stop_ids:
                    ids, finish = ids[:i + 1], "stop"
                    break
        sequence.generated += len(ids)
        text = "".join(chr(97 + token % 26) for token in ids if token not in sequence.stop_ids)
        if sequence.stops is not None:
            text = sequence.stops.add(text)
            if sequence.stops.stopped:
                finish = "stop"
        if finish is None and sequence.generated >= request.sampling.max_tokens:
            finish = "length"
            if sequence.stops is not None:
                text += sequence.stops.flush()
        if finish is not None:
            del self._running[id(sequence.stream)]
        sequence.stream.put(RequestOutput(text=text, token_ids=ids, finish_reason=finish))

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._on_fatal(task.exception())

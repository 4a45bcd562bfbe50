"""ProcessEngine: the worker's side of an engine in its own process (engine.own_process; the other
side is hosted.py).

In one process, the engine thread and the event loop (gRPC, admission, tokenizing, each stream's
writes) take turns on one interpreter lock: where a step is bound by the host, as a small model's
is on a GPU, every request's work on the loop is taken from the steps. Here the loop keeps the
lock to itself, and the engine's process runs the engine with little else beside it.

The engine class is built here too, never loaded: the `front`. Once the process has loaded the
model, the front gets its info and tokenizer (hosted.front_of), so prompts are encoded,
requests validated and constraints compiled here, before admission, as with an engine in
process; a compiled grammar crosses serialized. Each request's stream here is fed by the
process's events, in order, so merging, early release (`ending`) and failures behave as they
do in one process. If the process dies, every open stream fails with EngineDead and the worker
is told (on_fatal), as when an engine thread dies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import subprocess
import sys
from typing import Any

from worker.config import Config
from worker.engines import hosted
from worker.engines.base import BaseEngine, Capabilities, ModelInfo, RequestStream
from worker.engines.detokenizer import OutputText
from worker.engines.hosted import CACHE, ENDING, FAIL, PUT, SYNC, Channel
from worker.errors import EngineDead
from worker.request import GenerationRequest, RequestOutput, SamplingParams
from worker.telemetry import get_logger

log = get_logger(__name__)
STOP_TIMEOUT_S = 30.0  # for the process to stop its engine and exit once told, before it is killed


class ProcessEngine(BaseEngine):
    def __init__(self, config: Config, on_fatal, front: BaseEngine):
        super().__init__(config, on_fatal)
        self.front = front
        self.name = front.name
        self.paces_messages = front.paces_messages
        self.events = front.events  # fed with the process's cache changes
        self._process: subprocess.Popen | None = None
        self._channel: Channel | None = None
        self._reader: asyncio.Task | None = None
        self._streams: dict[int, RequestStream] = {}  # key -> the request's stream, while open
        self._keys: dict[int, int] = {}  # id(stream) -> key
        # key -> the text of a request the engine leaves to this side (BaseEngine.leaves_text), and
        # its sampling; eos ids: the engine's, when it leaves text (else None).
        self._texts: dict[int, tuple[OutputText, SamplingParams]] = {}
        self._eos_ids: frozenset[int] | None = None
        self._next_key = itertools.count()
        self._reply: asyncio.Future | None = None  # what load, warm-up and stop wait for
        self._kv_budget_tokens = 0
        self._counters: tuple = (0, 0.0, None, None)
        self._memory: dict[str, int] = {}
        self._stopping = False
        self._dead: BaseException | None = None

    # --- what the front answers, here ---

    def capabilities(self) -> Capabilities:
        return self.front.capabilities()

    def encode(self, request: GenerationRequest) -> list[int]:
        return self.front.encode(request)

    def prepare(self, request: GenerationRequest) -> None:
        self.front.prepare(request)
        if request.grammar is not None:  # on a thread, as prepare is when there is a constraint
            request.grammar = self.front.grammars.serialize(request.grammar)

    def token_bytes(self, token_id: int) -> bytes:
        return self.front.token_bytes(token_id)

    # --- the process ---

    async def load_model(self) -> ModelInfo:
        loop = asyncio.get_running_loop()
        # A new interpreter, not a fork: the worker's process runs gRPC's threads, and whatever
        # started the worker (cy-llm, pytest) is not the engine's main module.
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen([sys.executable, "-m", "worker.engines.hosted", str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()])
        theirs.close()
        self._channel = await Channel.open(ours)
        self._stopping, self._dead = False, None
        self._reply = loop.create_future()
        engine = dataclasses.replace(self.config.engine, own_process="false")  # there, the engine itself
        self._send(dataclasses.replace(self.config, engine=engine))
        self._reader = asyncio.create_task(self._read())
        log.info("engine process started", engine=self.name, pid=self._process.pid)
        front = await self._reply
        hosted.front_of(self.front, front)
        self.info, self.tokenizer = self.front.info, self.front.tokenizer
        self._kv_budget_tokens = front["kv_budget_tokens"]
        self._eos_ids = front["leaves_text"]
        return self.info

    async def warmup(self) -> None:
        self._reply = asyncio.get_running_loop().create_future()
        self._send(("warmup",))
        await self._reply

    async def unload_model(self) -> None:
        process, self._stopping = self._process, True
        if process is None:
            return
        if self.info is None:  # still loading: a load runs to its end (minutes); it is not waited for
            process.kill()
        elif self._channel is not None:
            self._reply = asyncio.get_running_loop().create_future()
            self._send(("stop",))
            try:
                await asyncio.wait_for(asyncio.shield(self._reply), STOP_TIMEOUT_S)
            except (TimeoutError, EngineDead):
                pass
        try:
            await asyncio.to_thread(process.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("engine process did not stop; killed", pid=process.pid)
            process.kill()
            await asyncio.to_thread(process.wait)
        self._gone(EngineDead("engine stopped"))

    def stream_predict(self, request: GenerationRequest) -> RequestStream:
        stream = RequestStream(request.request_id)
        if self._dead is not None:
            stream.fail(EngineDead("engine stopped"))
            return stream
        key = next(self._next_key)
        self._send(("add", key, request))  # first: a request that does not pickle holds nothing
        self._streams[key], self._keys[id(stream)] = stream, key
        params = request.sampling
        if self._eos_ids is not None and not params.stop:
            self._texts[key] = OutputText(self.tokenizer, request.prompt_token_ids, (), self._eos_ids), params
        return stream

    def abort(self, stream: RequestStream) -> None:
        key = self._keys.get(id(stream))
        if key is not None and self._dead is None:
            self._send(("abort", key))

    def kv_budget_tokens(self) -> int:
        return self._kv_budget_tokens

    def num_unfinished(self) -> int:
        return self._counters[0]

    def speculation_stats(self) -> tuple[int, int, int] | None:
        return self._counters[2]

    def prefix_cache_stats(self) -> tuple[int, int] | None:
        return self._counters[3]

    def get_memory_usage(self) -> dict[str, int]:
        return self._memory

    def _send(self, message: object) -> None:
        if self._channel is not None:  # else the process is gone
            self._channel.send(message)

    async def _read(self) -> None:
        while self._channel is not None:
            try:
                message = await self._channel.receive()
            except EOFError:
                self._lost()
                return
            try:
                self._on_message(message)
            except Exception:  # noqa: BLE001 - as a loop callback's would be: logged, and the next read
                log.exception("an engine message failed", kind=message[0])

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "batch":
            self._on_events(message[1])
            self._set_counters(message[2])
        elif kind == "counters":
            self._set_counters(message[1])
            self._memory = message[2]
        elif kind in ("loaded", "warmed", "stopped"):
            _settle(self._reply, message[1] if len(message) > 1 else None)
        elif kind == "failed":  # a load or warm-up; the process ends after a failed load
            self._dead = self._dead or (message[1] if self.info is None else None)
            _settle(self._reply, error=message[1])
        elif kind == "fatal":
            self._failed(EngineDead(f"engine failed: {message[1]}"))

    def _on_events(self, events: list[tuple]) -> None:
        streams = self._streams
        for key, kind, payload in events:
            if kind == PUT:
                if (stream := streams.get(key)) is not None:
                    payload = RequestOutput(*payload)
                    if payload.token_ids and (text := self._texts.get(key)) is not None:
                        renderer, params = text
                        payload.text = renderer.add_all(payload.token_ids, params.stop_token_ids, params.ignore_eos,
                                                        payload.finish_reason == "length")[0]
                    stream.put(payload)
                    if payload.finish_reason is not None:
                        self._forget(key)
            elif kind == ENDING:
                if (stream := streams.get(key)) is not None:
                    stream.ending()
            elif kind == FAIL:
                if (stream := streams.get(key)) is not None:
                    stream.fail(payload)
                    self._forget(key)
            elif kind == CACHE:
                getattr(self.events, payload[0])(payload[1])
            elif kind == SYNC:  # two hops, as ThreadedEngine.after_admissions
                loop = asyncio.get_running_loop()
                loop.call_soon(loop.call_soon, self._send, ("sync", payload))

    def _set_counters(self, counters: tuple) -> None:
        self._counters = counters
        self.last_step_at = counters[1]

    def _forget(self, key: int) -> None:
        stream = self._streams.pop(key)
        self._keys.pop(id(stream), None)
        self._texts.pop(key, None)

    def _lost(self) -> None:
        """The socket closed: the process exited (told to stop, or after a failed load) or died."""
        if self._stopping or self._dead is not None:
            self._gone(EngineDead("engine stopped"))
            return
        log.error("engine process ended", engine=self.name, pid=self._process.pid)
        self._failed(EngineDead(f"the engine's process ended (pid {self._process.pid})"))

    def _failed(self, error: EngineDead) -> None:
        """The engine can serve nothing more. While loading or warming up, that load fails; after,
        the worker is told, as when an engine thread dies."""
        loading = self._reply is not None and not self._reply.done()
        self._gone(error)
        if not loading:
            self._on_fatal(error)

    def _gone(self, error: EngineDead) -> None:
        """Nothing more comes from the process: every open stream and waiter ends with `error`."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._dead = self._dead or error
        _settle(self._reply, error=error)
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        self._keys.clear()
        self._texts.clear()
        self._counters = (0, self.last_step_at, *self._counters[2:])


def _settle(future: asyncio.Future | None, result: Any = None, error: BaseException | None = None) -> None:
    if future is None or future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)

"""The engine's own process (engine.own_process): the engine from the factory, loaded and run here;
its streams' outputs and its cache's changes go to the worker's process (process.py) as one message
a wake-up of this process's event loop, with the engine's counters beside them.

Messages are pickled tuples over a Unix socket pair (Channel). From the worker, after the config:
("add", key, request), ("abort", key), ("sync", n), ("warmup",), ("stop",). To it: ("loaded",
front) or ("failed", error), ("warmed",) or ("failed", error), ("batch", events, counters),
("counters", counters, memory) every second, ("fatal", why), ("stopped",). An event is (key, PUT,
output.fields()), (key, ENDING, None), (key, FAIL, error), (None, CACHE, ("publish", changes) |
("stop", reason)) or (None, SYNC, n), which the worker answers with ("sync", n) once the requests
admitted into the slots the events before it gave back are sent.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import pickle
import signal
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

from worker.config import Config
from worker.engines.base import BaseEngine, RequestStream
from worker.errors import EngineDead
from worker.request import GenerationRequest, RequestOutput
from worker.telemetry import configure_logging, get_logger

log = get_logger(__name__)
PUT, ENDING, FAIL, CACHE, SYNC = range(5)
HEADER = struct.Struct("!I")  # a message's length
COUNTERS_EVERY_S = 1.0  # memory, and the last step's time while a long prompt sends nothing


def main(fd: int) -> None:
    """The process's entry: `python -m worker.engines.hosted FD`, FD its end of a Unix socket pair,
    on which the config comes first. Signals are for the worker: it drains, then says stop (a
    terminal's Ctrl-C reaches this process too, and must not end it first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from worker.cli import run_async

    run_async(_serve(fd))


async def _serve(fd: int) -> None:
    channel = await Channel.open(socket.socket(fileno=fd))
    config: Config = await channel.receive()
    configure_logging(config.server.log_level)
    await Host(config, channel).serve()


class Channel:
    """Pickled messages over a connected Unix socket, each after its length, on the event loop
    (never blocking it: a long prompt's message arrives in parts)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, sock: socket.socket) -> Channel:
        return cls(*await asyncio.open_unix_connection(sock=sock))

    def send(self, message: object) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(HEADER.pack(len(data)) + data)

    async def receive(self) -> Any:
        """The next message; EOFError once the other side has closed."""
        try:
            size, = HEADER.unpack(await self.reader.readexactly(HEADER.size))
            return pickle.loads(await self.reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            raise EOFError from None

    def close(self) -> None:
        self.writer.close()


def settle() -> None:
    """What is loaded by now lives as long as the process: frozen, a full collection no longer walks
    it (as the worker's process does, server.py; both unfreeze before they exit). This process runs
    the steps: unfrozen (~400k objects, a full collection 184 ms on a 2-core Xeon), one held the
    engine thread 164 ms between two steps of a batch-64 decode on an H200 host, whose steps were
    1.2 ms apart but for that."""
    gc.collect()
    gc.freeze()


def portable(error: BaseException) -> BaseException:
    """`error` if it crosses to the other process as itself, else an EngineDead naming it."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - an exception whose __init__ does not take its args
        return EngineDead(f"{type(error).__name__}: {error}")
    return error


class Host:
    """Serves one engine for the worker over `channel` until told to stop or the worker is gone."""

    def __init__(self, config: Config, channel: Channel):
        from worker.engines.factory import create_engine

        self.channel = channel
        self.engine: BaseEngine = create_engine(config, self._on_fatal)
        self.engine.make_stream = self._stream
        self.engine.leaves_text = self.engine.can_leave_text  # the worker's process renders it
        if self.engine.events is not None:
            self.engine.events.forward = lambda call: self.post((None, CACHE, call))
        if hasattr(self.engine, "after_admissions"):  # a ThreadedEngine
            self.engine.after_admissions = self._after_admissions
        self._syncs: dict[int, Callable[[], None]] = {}
        self._next_sync = itertools.count()
        self.streams: dict[int, ForwardedStream] = {}
        self.events: list[tuple] = []
        self._adding = -1  # the key of the request stream_predict is making a stream for
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            await engine.load_model()
        except BaseException as exc:  # noqa: BLE001 - the worker reports it
            self.channel.send(("failed", portable(exc)))
            await self.channel.writer.drain()
            return
        settle()
        grammars = engine.grammars
        self.channel.send(("loaded", {
            "info": engine.info, "tokenizer": engine.tokenizer, "speculates": engine.speculates,
            "kv_budget_tokens": engine.kv_budget_tokens(),
            "leaves_text": engine.eos_ids if engine.leaves_text else None,  # what the worker's side renders with
            "grammars": (grammars.vocab_size, grammars.stop_ids) if grammars is not None else None}))
        tasks = [asyncio.create_task(self._report()), asyncio.create_task(self._read())]
        try:
            await self._stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await engine.unload_model()  # open streams get their "aborted" outputs
            self._flush()
            # Frozen objects are never collected, so at exit nanobind would report Triton's as
            # leaks: lines that are not JSON on the worker's stderr, which is this process's.
            gc.unfreeze()
        self.channel.send(("stopped",))
        await self.channel.writer.drain()
        self.channel.close()

    async def _read(self) -> None:
        while True:
            try:
                message = await self.channel.receive()
            except EOFError:  # the worker's process ended: nobody left to serve
                log.warning("the worker's process is gone; the engine stops")
                self._stop.set()
                return
            self._on_message(message)

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            self._add(message[1], message[2])
        elif kind == "abort":
            if (stream := self.streams.get(message[1])) is not None:
                self.engine.abort(stream)
        elif kind == "sync":
            if (callback := self._syncs.pop(message[1], None)) is not None:
                callback()
        elif kind == "warmup":
            asyncio.create_task(self._warm_up())
        elif kind == "stop":
            self._stop.set()

    def _add(self, key: int, request: GenerationRequest) -> None:
        try:
            if isinstance(request.grammar, str):
                request.grammar = self.engine.grammars.deserialize(request.grammar)
            self._adding = key
            self.engine.stream_predict(request)
        except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the engine
            log.exception("request failed in the engine's process", request_id=request.request_id)
            self.streams.pop(key, None)
            self.post((key, FAIL, portable(exc)))

    def _after_admissions(self, callback: Callable[[], None]) -> None:
        """ThreadedEngine.after_admissions, where the admissions happen in the worker's process."""
        number = next(self._next_sync)
        self._syncs[number] = callback
        self.post((None, SYNC, number))

    def _stream(self, request_id: str) -> RequestStream:
        key, self._adding = self._adding, -1
        if key < 0:  # the engine's own request (its warm-up), read here
            return RequestStream(request_id)
        stream = ForwardedStream(request_id)
        stream.key, stream.host = key, self
        self.streams[stream.key] = stream
        return stream

    async def _warm_up(self) -> None:
        try:
            await self.engine.warmup()
        except Exception as exc:  # noqa: BLE001 - the worker reports it
            self.channel.send(("failed", portable(exc)))
            return
        settle()
        # Counters as the warm-up leaves them (reset): the last ones sent held its requests' counts,
        # and the worker showed those as the service's until the next report.
        self.channel.send(("counters", self._counters(), self.engine.get_memory_usage()))
        self.channel.send(("warmed",))

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(COUNTERS_EVERY_S)
            self.channel.send(("counters", self._counters(), self.engine.get_memory_usage()))

    def _counters(self) -> tuple:
        engine = self.engine
        return engine.num_unfinished(), engine.last_step_at, engine.speculation_stats(), engine.prefix_cache_stats()

    def _on_fatal(self, error: BaseException) -> None:
        self._flush()
        self.channel.send(("fatal", f"{type(error).__name__}: {error}"))

    def post(self, event: tuple) -> None:
        """Queues an event for the worker; the first of a wake-up schedules the message that takes
        them all (a step's outputs arrive in one callback, engines/threaded.py)."""
        if not self.events:
            self._loop.call_soon(self._flush)
        self.events.append(event)

    def _flush(self) -> None:
        if self.events:
            events, self.events = self.events, []
            self.channel.send(("batch", events, self._counters()))


class ForwardedStream(RequestStream):
    """A request's stream in the engine's process: what the engine puts goes to the worker's
    stream of the same key, which buffers, merges and releases as RequestStream does."""

    __slots__ = ("key", "host")

    def put(self, output: RequestOutput) -> None:
        if self.finished:
            return
        if output.finish_reason is not None:
            self.finished = True
            self.host.streams.pop(self.key, None)
        self.host.post((self.key, PUT, output.fields()))

    def ending(self) -> None:
        if not self.finished:
            self.host.post((self.key, ENDING, None))

    def fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self.finished = True
        self.host.streams.pop(self.key, None)
        self.host.post((self.key, FAIL, portable(error)))


def front_of(engine: BaseEngine, front: dict[str, Any]) -> None:
    """Gives `engine`, built in the worker's process and never loaded, what encoding, validating
    and compiling constraints need of the loaded one: its model's info and tokenizer."""
    engine.info, engine.tokenizer, engine.speculates = front["info"], front["tokenizer"], front["speculates"]
    if front["grammars"] is not None:
        engine._load_grammars(*front["grammars"])


if __name__ == "__main__":
    main(int(sys.argv[1]))

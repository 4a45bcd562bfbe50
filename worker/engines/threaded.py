"""ThreadedEngine: the plumbing of an engine whose model runs on one thread of its own.

Requests reach the thread through an inbox; outputs cross back to the event loop with
call_soon_threadsafe; an exception escaping the thread fails every open stream and is fatal.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from abc import abstractmethod
from typing import Any, Callable

from worker.engines.base import BaseEngine, ModelInfo, RequestStream
from worker.errors import EngineDead
from worker.request import RequestOutput
from worker.telemetry import get_logger

log = get_logger(__name__)


class ThreadedEngine(BaseEngine):
    def __init__(self, config, on_fatal=None):
        super().__init__(config, on_fatal)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._syncs = 0  # markers sent by _take_inbox(sync_s=...); a late one is ignored
        self._stopping = False
        self._loaded: asyncio.Future | None = None  # settled once _load has returned or raised
        self._abandoned: threading.Thread | None = None  # still loading when unload_model returned

    @abstractmethod
    def _load(self) -> None:
        """Loads the model and sets self.info, on the engine thread: every torch call of the engine
        then comes from one thread. On CPU that keeps one OpenMP thread team in the process, and
        libgomp lets a team's idle threads spin (rather than sleep between parallel regions) only
        while all its threads fit the cores: once a load thread had made a second team, a batch-8
        SmolLM2 step with 2 threads on 2 cores went from 34 to 50-59 ms."""

    @abstractmethod
    def _serve(self) -> None:
        """The engine thread's loop; returns once ("stop", None) comes through the inbox."""

    @abstractmethod
    def _open_streams(self) -> list[RequestStream]:
        """Streams of the requests the engine thread still holds."""

    @abstractmethod
    def _release(self) -> None:
        """Drops the model and caches once the thread has stopped."""

    @abstractmethod
    def _on_add(self, item: Any) -> None:
        """A new request reached the engine thread."""

    @abstractmethod
    def _on_abort(self, stream: RequestStream) -> None:
        """Drops the request of `stream`, if the engine still holds it."""

    def abort(self, stream: RequestStream) -> None:
        self._inbox.put(("abort", stream))

    def after_admissions(self, callback: Callable[[], None]) -> None:
        """On the event loop: runs `callback` once the requests admitted into the slots that what
        the loop just ran gave back have reached the engine. Two hops: those outputs' callbacks
        wake the admitted requests' tasks with call_soon, and the second call_soon runs after them.
        (In an engine's own process, the admissions happen in the worker's: hosted.py.)"""
        self._loop.call_soon(callback)

    def _take_inbox(self, block: bool, sync_s: float = 0.0) -> bool:
        """On the engine thread: applies adds and aborts; False once asked to stop.

        With `sync_s`, it also waits (at most that long) until the event loop has run what the
        thread posted before: an output that ended a request gives its slot back there, and the
        request admitted into it is added before the loop sends the marker. The thread's next
        step then runs it rather than leaving its row empty for a step.
        """
        marker, until = None, time.monotonic() + sync_s
        if sync_s > 0 and not block and self._loop is not None:
            self._syncs += 1
            marker = self._syncs
            self._loop.call_soon_threadsafe(self.after_admissions, functools.partial(self._inbox.put, ("sync", marker)))
        while not self._stopping:
            try:
                if marker is not None:
                    kind, item = self._inbox.get(timeout=max(0.0, until - time.monotonic()))
                else:
                    kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                self._stopping = True
            elif kind == "add":
                self._on_add(item)
            elif kind == "abort":
                self._on_abort(item)
            elif item == marker:
                marker = None
        return False

    async def load_model(self) -> ModelInfo:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        loaded = self._loaded = self._loop.create_future()
        thread = self._thread = threading.Thread(target=self._thread_main, args=(loaded,), name=f"{self.name}-engine",
                                                 daemon=True)
        thread.start()
        try:
            await loaded
        except Exception:
            await asyncio.to_thread(thread.join)
            self._thread = None
            raise
        return self.info

    async def unload_model(self) -> None:
        if self._thread is not None:
            self._inbox.put(("stop", None))
            if not self._loaded.done():
                # Stopped while loading: a load runs to its end (minutes for a large model) and
                # there is nothing to drain, so the worker does not wait; the thread stops once
                # loaded, or ends with the process (a daemon).
                log.warning("stopped while the model loads", engine=self.name)
                self._abandoned, self._thread = self._thread, None
                return
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._release()

    def still_loading(self) -> bool:
        return self._abandoned is not None and self._abandoned.is_alive()

    def _refused(self, request_id: str) -> RequestStream | None:
        """A stream already failed, when the engine thread has died."""
        if self._dead is None:
            return None
        stream = self.make_stream(request_id)
        stream.fail(EngineDead("engine stopped"))
        return stream

    def _thread_main(self, loaded: asyncio.Future) -> None:
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - the caller of load_model gets it
            self._loop.call_soon_threadsafe(_settle, loaded, exc)
            return
        self._loop.call_soon_threadsafe(_settle, loaded, None)
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - anything here means the engine cannot go on
            self._dead = exc
            log.error("engine thread failed", engine=self.name, error=repr(exc))
            for stream in self._open_streams():
                self._post(stream.fail, EngineDead(f"engine failed: {type(exc).__name__}"))
            self._loop.call_soon_threadsafe(self._on_fatal, exc)
            return
        for stream in self._open_streams():
            self._post(stream.put, RequestOutput(finish_reason="aborted"))

    def _post(self, callback: Callable[[Any], None], argument: Any) -> None:
        self._loop.call_soon_threadsafe(callback, argument)

    def _post_all(self, calls: list[tuple[Callable[[Any], None], Any]]) -> None:
        """Several calls in one wake-up of the loop (each call_soon_threadsafe writes to its self-pipe)."""
        if calls:
            self._loop.call_soon_threadsafe(_run_all, calls)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # a load_model that was cancelled no longer waits
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _run_all(calls: list[tuple[Callable[[Any], None], Any]]) -> None:
    for callback, argument in calls:
        callback(argument)

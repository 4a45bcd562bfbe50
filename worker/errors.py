"""The worker's exceptions and the one map from them to gRPC status codes."""

from __future__ import annotations

import grpc


class WorkerError(Exception):
    """Base of every error a request can end with; `code` is its gRPC status."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(WorkerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(WorkerError):
    code = grpc.StatusCode.NOT_FOUND


class AdapterNotFound(WorkerError):
    code = grpc.StatusCode.NOT_FOUND


class QueueFull(WorkerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "queue_full"


class QueueTimeout(WorkerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "queue_timeout"


class OverBudget(WorkerError):
    """The request alone needs more KV budget than the worker (or its tenant's share) holds in total."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "over_budget"


class ClientStalled(WorkerError):
    """The client took no message for server.stall_timeout_s; generating on would only fill memory."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "client_stalled"


class DeviceOutOfMemory(WorkerError):
    """The device ran out of memory on this request; caches were freed and others go on."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Draining(WorkerError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "draining"


class NotReady(WorkerError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "not_ready"


class EngineDead(WorkerError):
    """The engine cannot serve anything any more; the worker goes NOT_SERVING and exits."""

    code = grpc.StatusCode.UNAVAILABLE


class RequestDeadlineExceeded(WorkerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "deadline"


class EngineRequestError(WorkerError):
    """A fault on one request; the engine keeps serving the others."""

    code = grpc.StatusCode.INTERNAL


class NoCacheEvents(WorkerError):
    """The engine publishes no prefix-cache events (WorkerControl.CacheEvents)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class CacheSubscriberLagging(WorkerError):
    """A CacheEvents subscriber fell too far behind; it must subscribe again."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and client-facing message for an exception; internals never leak."""
    if isinstance(exc, WorkerError):
        return exc.code, str(exc) or type(exc).__name__
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
    return grpc.StatusCode.INTERNAL, "internal error"

"""The adapter interface, its errors, and the adapters built from the config's `adapters.named`.

An adapter may rewrite a request before tokenization (`prepare_prompt`, run off the event loop) and
rewrite each output message's text (`process_output`). It fails with an AdapterError, which ends
that one request with the error's status; the slot it held is released like any other's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import grpc

from worker.config import ConfigError
from worker.errors import WorkerError
from worker.request import GenerationRequest, RequestOutput

TokenCounter = Callable[[str], int]


class AdapterError(WorkerError):
    """An adapter could not prepare a request (its knowledge base is missing, say)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AdapterInputError(AdapterError):
    """The request does not suit the adapter (token ids where it needs text)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Adapter(ABC):
    kind: str

    def __init__(self, name: str):
        self.name = name

    @abstractmethod
    def prepare_prompt(self, request: GenerationRequest, count_tokens: TokenCounter) -> GenerationRequest:
        """The request to run instead: its prompt or chat rewritten."""

    def process_output(self, output: RequestOutput) -> RequestOutput:
        """Each output message before it is sent; the default passes it on unchanged."""
        return output

    def close(self) -> None:
        pass


def build_adapters(named: dict[str, dict[str, Any]], kb_dir: Path) -> dict[str, Adapter]:
    """Adapters from the config's adapters.named, built where the config is consumed (the worker's
    start); a bad spec is a ConfigError naming its key, e.g. adapters.named.docs.top_k."""
    from worker.adapters.rag import RagAdapter
    from worker.adapters.system_prompt import SystemPromptAdapter

    kinds = {cls.kind: cls for cls in (RagAdapter, SystemPromptAdapter)}
    adapters = {}
    for name, spec in named.items():
        if not isinstance(spec, dict) or spec.get("type") not in kinds:
            raise ConfigError(f"adapters.named.{name}.type", f"must be one of {', '.join(sorted(kinds))}")
        options = {k: v for k, v in spec.items() if k != "type"}
        try:
            adapters[name] = kinds[spec["type"]].from_options(name, options, kb_dir)
        except (TypeError, ValueError) as exc:
            key, _, message = str(exc).partition(": ")
            raise ConfigError(f"adapters.named.{name}.{key}", message) from None
    return adapters


def require(options: dict[str, Any], key: str, kind: type, default: Any = None, low: float | None = None,
            high: float | None = None) -> Any:
    """One option of an adapter spec, checked; errors read "key: message"."""
    value = options.pop(key, default)
    if value is None:
        raise ValueError(f"{key}: must be set")
    if kind is int and isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"{key}: {value!r} is not a {kind.__name__}")
    if low is not None and not low <= value <= high:
        raise ValueError(f"{key}: {value} is outside [{low}, {high}]")
    return value


def reject_unknown(options: dict[str, Any], known: str) -> None:
    if options:
        raise ValueError(f"{sorted(options)[0]}: unknown option; expected {known}")

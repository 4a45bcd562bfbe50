"""BaseEngine, the interface every engine implements, and RequestStream, how outputs reach a request."""

from __future__ import annotations

import asyncio
import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from worker.engines import grammar
from worker.engines.grammar import KINDS, Grammars
from worker.errors import InvalidRequest
from worker.request import MAX_LOGPROBS, GenerationRequest, RequestOutput, SamplingParams
from worker.telemetry import get_logger

if TYPE_CHECKING:
    from worker.config import Config
    from worker.engines.cache_events import CacheEvents

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine does beyond plain text (WorkerInfo.capabilities)."""

    structured_output: tuple[str, ...] = ()
    max_logprobs: int = 0
    prompt_logprobs: bool = False
    tools: bool = False
    speculative_decoding: bool = False


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the worker needs to know of a loaded model to validate and admit requests."""

    served_name: str
    max_model_len: int
    vocab_size: int
    kv_bytes_per_token: int
    """layers x 2 x kv heads x head dim x dtype size; 0 when the engine keeps no KV cache."""


class RequestStream:
    """The outputs of one request, in order. Written by the engine on the event loop thread.

    A consumer that falls behind receives the pending outputs merged into one, so a slow
    transport sends fewer, larger messages instead of queueing one per token.
    """

    __slots__ = ("request_id", "finished", "on_finish", "_pending", "_error", "_ready")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self.on_finish: Callable[[], None] | None = None
        """Called once, when the engine will compute nothing more for the request (ending()), or
        else when it has put the request's last output."""
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.finished or self._error is not None:
            return
        if self._pending is None:
            self._pending = output
            self._ready.set()
        else:
            self._pending.merge(output)
        if output.finish_reason is not None:
            self.finished = True
            if self.on_finish is not None:
                self.on_finish()

    def ending(self) -> None:
        """The step that makes the request's last token is under way, and the engine runs nothing
        more of it: on_finish runs now, so the slot is taken by the next request while that step
        runs (else the row stays empty for the steps until the last output reaches the event
        loop and the admitted request reaches the engine). Its blocks go back once the step is read."""
        if self.finished or self._error is not None or self.on_finish is None:
            return
        callback, self.on_finish = self.on_finish, None
        callback()

    def fail(self, error: BaseException) -> None:
        """Ends the stream with an error; what was not yet read is dropped."""
        if self.finished and self._pending is None:
            return
        self.finished = True
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        while True:
            if self._error is not None:
                raise self._error
            if self._pending is not None:
                output, self._pending = self._pending, None
                self._ready.clear()
                return output
            await self._ready.wait()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._pending is None and self._error is None:
            raise StopAsyncIteration
        return await self.get()


ENDING = operator.methodcaller("ending")
"""stream.ending() as a callback posted to the loop (engines/threaded.py), whatever the stream's class."""


def message_spacing(streams: int, max_messages_per_s: float, min_interval_s: float) -> float:
    """Seconds between two messages of one stream: running streams / server.max_messages_per_s (0:
    no rate), and at least server.min_message_interval_s. The native engine spaces its streams so
    at the source (messages.py), the servicer the other engines'."""
    return max(min_interval_s, streams / max_messages_per_s if max_messages_per_s else 0.0)


class BaseEngine(ABC):
    """Loads a model, turns requests into token streams, aborts them, and says what it can hold."""

    name: str
    # Keys of the registry's performance preset this engine takes as engine arguments.
    preset_args: tuple[str, ...] = ()
    # The warm-up prompt's length (native: long enough to measure its prefill rate).
    warmup_prompt_tokens: int = 1
    # Whether it reports logprobs (generated and prompt tokens) and renders tools into chat prompts.
    reports_logprobs = True
    renders_tools = True
    speculates = False  # whether requests may ask for speculative decoding (native: unless configured off)
    paces_messages = False  # whether it spaces each stream's outputs by server.max_messages_per_s itself
    # Whether it can leave the text of requests with no stop strings to whoever reads its streams
    # (their outputs then carry token ids only), and whether it does: set in an engine's own
    # process (hosted.py), whose worker side renders them (process.py).
    can_leave_text = False
    leaves_text = False

    def __init__(self, config: Config, on_fatal: Callable[[BaseException], None] | None = None):
        self.config = config
        self.info: ModelInfo | None = None
        # The prefix cache's changes (WorkerControl.CacheEvents), for engines that publish them.
        self.events: CacheEvents | None = None
        # Called once if the engine can no longer serve anything; the worker then exits.
        self._on_fatal = on_fatal or (lambda error: None)
        # time.monotonic() of the last step the engine completed (a prefill chunk or a decode),
        # written by engines that can see their steps: the progress watchdog reads it, so a long
        # prompt that sends nothing for a while still counts as progress. Others rely on outputs.
        self.last_step_at = 0.0
        # Set by engines that compile structured-output constraints for their tokenizer once loaded.
        self.grammars: Grammars | None = None
        self.tokenizer: Any = None
        # How the engine makes a request's stream: in an engine's own process (hosted.py), one
        # that forwards its outputs to the worker's.
        self.make_stream: Callable[[str], RequestStream] = RequestStream

    def capabilities(self) -> Capabilities:
        return Capabilities(
            structured_output=KINDS if self.grammars is not None else (),
            max_logprobs=MAX_LOGPROBS if self.reports_logprobs else 0,
            prompt_logprobs=self.reports_logprobs, tools=self.renders_tools, speculative_decoding=self.speculates)

    def prepare(self, request: GenerationRequest) -> None:
        """Refuses what this engine cannot do, naming it, and compiles the request's constraint
        (on a thread: a new schema may take milliseconds). Before admission."""
        able = self.capabilities()
        if request.constraint is not None:
            if request.constraint.kind not in able.structured_output:
                hint = " (it needs xgrammar, which cy-llm setup installs)" if self.reports_logprobs else ""
                raise InvalidRequest(f"structured_output.{request.constraint.kind} is not supported by the "
                                     f"{self.name} engine{hint}")
            request.grammar = self.grammars.compile(request.constraint)
        for field_name in ("logprobs", "prompt_logprobs"):
            if getattr(request, field_name) is not None and not able.max_logprobs:
                raise InvalidRequest(f"{field_name} is not supported by the {self.name} engine")
        if request.tools and not able.tools:
            raise InvalidRequest(f"chat.tools_json is not supported by the {self.name} engine")
        if request.speculative:
            if not able.speculative_decoding:
                raise InvalidRequest(f"speculative decoding is not supported by the {self.name} engine"
                                     + (" as configured (engine.args.speculative_tokens is 0)" if self.name == "native" else ""))
            if request.constraint is not None or request.sampling.is_penalized or request.logprobs is not None \
                    or request.prompt_logprobs is not None:
                raise InvalidRequest("speculative decoding runs without structured_output, penalties, logprobs and "
                                     "prompt_logprobs; leave speculative unset or false with them")

    def _load_grammars(self, vocab_size: int, stop_ids: frozenset[int]) -> None:
        """On the engine's tokenizer, once loaded; without xgrammar, structured output is refused."""
        if grammar.available():
            self.grammars = Grammars(self.tokenizer, vocab_size, stop_ids)
        else:
            log.warning("xgrammar is not installed: structured output is refused", engine=self.name)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, for logprobs."""
        if self.grammars is not None:
            return self.grammars.token_bytes(token_id)
        return self.tokenizer.decode([token_id]).encode() if self.tokenizer is not None else b""

    @abstractmethod
    async def load_model(self) -> ModelInfo:
        """Loads weights and starts the engine; returns what requests are checked against."""

    @abstractmethod
    async def unload_model(self) -> None:
        """Stops the engine and gives its memory back; every open stream ends."""

    def still_loading(self) -> bool:
        """Whether a load that unload_model did not wait for still runs (the process must end
        without finalizing around it)."""
        return False

    @abstractmethod
    def encode(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids: the prompt text, or the chat rendered with the model's template."""

    @abstractmethod
    def stream_predict(self, request: GenerationRequest) -> RequestStream:
        """Starts generating for a request whose prompt_token_ids are set; outputs go to the stream."""

    @abstractmethod
    def abort(self, stream: RequestStream) -> None:
        """Stops a request between tokens and frees what it holds; safe to call after it finished."""

    @abstractmethod
    def kv_budget_tokens(self) -> int:
        """How many tokens (prompt + max_tokens over running requests) the engine can hold."""

    def get_memory_usage(self) -> dict[str, int]:
        """Bytes in use per device ("cpu", "cuda:0", ...)."""
        return {}

    @abstractmethod
    def num_unfinished(self) -> int:
        """Requests the engine itself still holds (0 once every stream ended or was aborted)."""

    def speculation_stats(self) -> tuple[int, int, int] | None:
        """(rows verified, tokens proposed, tokens accepted) since start; None where it does not speculate."""
        return None

    def prefix_cache_stats(self) -> tuple[int, int] | None:
        """(prompt tokens looked up in the prefix cache, tokens found there) since start; None
        for an engine whose prefix cache is not visible here."""
        return None

    def count_tokens(self, text: str) -> int:
        """Tokens `text` takes as a plain prompt (adapters budget their insertions with it)."""
        return len(self.encode(GenerationRequest(request_id="count", sampling=SamplingParams(), prompt=text)))

    def check_token_ids(self, token_ids: list[int] | tuple[int, ...], field_name: str) -> None:
        vocab = self.info.vocab_size
        for token_id in token_ids:
            if token_id >= vocab:
                raise InvalidRequest(f"{field_name} holds {token_id}, outside the vocabulary of {vocab}")

    async def warmup(self) -> None:
        """One real forward pass, so readiness means the model answers."""
        request = GenerationRequest(
            request_id="warmup", sampling=SamplingParams(max_tokens=2, ignore_eos=True),
            prompt_token_ids=[0] * self.warmup_prompt_tokens)
        async for _ in self.stream_predict(request):
            pass

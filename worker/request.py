"""A generation request and its output, as the scheduler and engines see them (no protobuf past here)."""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.errors import InvalidRequest

if TYPE_CHECKING:
    from worker.config import SamplingDefaults
    from worker.gen.cyllm.inference.v1 import inference_pb2 as pb

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_METADATA_ENTRIES = 64
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 turns top-k off."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def truncates(self, vocab: int) -> bool:
        """Whether top-k, top-p or min-p can drop any of a vocabulary this size."""
        return 0 < self.top_k < vocab or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def is_penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def validate(self) -> None:
        _require(self.max_tokens >= 1, "sampling.max_tokens must be at least 1")
        _require(_finite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
                 f"sampling.temperature must be a number in [0, {MAX_TEMPERATURE}]")
        _require(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "sampling.top_p must be in (0, 1]")
        _require(self.top_k >= 0, "sampling.top_k must be 0 (off) or positive")
        _require(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "sampling.min_p must be in [0, 1]")
        _require(_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
                 f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_finite(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                     f"sampling.{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}]")
        _require(len(self.stop) <= MAX_STOP_STRINGS, f"sampling.stop holds at most {MAX_STOP_STRINGS} strings")
        for stop in self.stop:
            _require(0 < len(stop) <= MAX_STOP_STRING_CHARS,
                     f"sampling.stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters")
        _require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                 f"sampling.stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    sampling: SamplingParams
    model: str = ""
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: list[int] | None = None
    """Given by the client, or filled in by the engine's encode() before admission."""
    priority: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    return_token_ids: bool = False
    adapter: str = ""

    @classmethod
    def from_pb(cls, message: pb.PredictRequest, defaults: SamplingDefaults) -> GenerationRequest:
        """Converts and validates a PredictRequest; unset sampling fields take the defaults."""
        request_id = message.request_id or uuid.uuid4().hex
        _require(REQUEST_ID_PATTERN.fullmatch(request_id) is not None,
                 "request_id must be 1-128 characters of letters, digits and ._:-")
        _require(len(message.metadata) <= MAX_METADATA_ENTRIES,
                 f"metadata holds at most {MAX_METADATA_ENTRIES} entries")
        kind = message.WhichOneof("input")
        prompt = messages = token_ids = None
        if kind == "prompt":
            prompt = message.prompt
            _require(prompt != "", "prompt is empty")
        elif kind == "chat":
            messages = tuple(ChatMessage(m.role, m.content) for m in message.chat.messages)
            _require(len(messages) > 0, "chat has no messages")
            for index, chat_message in enumerate(messages):
                _require(chat_message.role in CHAT_ROLES,
                         f"chat.messages[{index}].role {chat_message.role!r} is not one of "
                         f"{', '.join(sorted(CHAT_ROLES))}")
        elif kind == "token_ids":
            token_ids = list(message.token_ids.ids)
            _require(len(token_ids) > 0, "token_ids is empty")
        else:
            raise InvalidRequest("no input: set one of prompt, chat or token_ids")
        s = message.sampling
        sampling = SamplingParams(
            max_tokens=s.max_tokens if s.HasField("max_tokens") else defaults.max_tokens,
            temperature=s.temperature if s.HasField("temperature") else defaults.temperature,
            top_p=s.top_p if s.HasField("top_p") else defaults.top_p,
            top_k=s.top_k if s.HasField("top_k") else defaults.top_k,
            min_p=s.min_p if s.HasField("min_p") else 0.0,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
            frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            seed=s.seed if s.HasField("seed") else None,
            ignore_eos=s.ignore_eos,
        )
        sampling.validate()
        return cls(
            request_id=request_id,
            model=message.model,
            prompt=prompt,
            messages=messages,
            prompt_token_ids=token_ids,
            sampling=sampling,
            priority=message.priority,
            metadata=dict(message.metadata),
            return_token_ids=message.return_token_ids,
            adapter=message.adapter,
        )


@dataclass(slots=True)
class RequestOutput:
    """New tokens and text since the previous output; finish_reason is set on the last one only."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """stop | length | aborted"""

    def merge(self, later: RequestOutput) -> None:
        """Folds a later delta into this one, for a consumer that fell behind the engine."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.finish_reason = later.finish_reason


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequest(message)


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))

"""A generation request and its output, as the scheduler and engines see them (no protobuf past here)."""

from __future__ import annotations

import json
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
MAX_LOGPROBS = 20
MAX_CHOICES = 256
MAX_TOOLS = 128
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


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

    def validate(self, scoring: bool = False) -> None:
        """`scoring`: the request asks for prompt logprobs, which is all max_tokens 0 can ask for."""
        _require(self.max_tokens >= 1 or (scoring and self.max_tokens == 0),
                 "sampling.max_tokens must be at least 1 (0 only with prompt_logprobs, to score a prompt)")
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
class ToolCall:
    id: str
    name: str
    arguments: str
    """A JSON object's text."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def template_dict(self) -> dict:
        """The message as chat templates read it (OpenAI's shape, arguments parsed: templates such as
        Llama's and Qwen's render them as JSON)."""
        message: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                     for c in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.name:
            message["name"] = self.name
        return message


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match: kind is one of CONSTRAINT_KINDS; spec the schema, pattern or
    grammar text, the choices as a JSON array, "" for json_object."""

    kind: str
    spec: str


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
    tools: list[dict] | None = None
    """OpenAI tool definitions, for the chat template."""
    constraint: Constraint | None = None
    grammar: object = None
    """The constraint compiled for the engine's tokenizer (set before admission); on its way to an
    engine in its own process, that serialized (str)."""
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    speculative: bool | None = None
    """None: the worker's setting."""

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
            messages = tuple(_chat_message(i, m) for i, m in enumerate(message.chat.messages))
            _require(len(messages) > 0, "chat has no messages")
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
        logprobs = _count(message, "logprobs")
        prompt_logprobs = _count(message, "prompt_logprobs")
        sampling.validate(scoring=prompt_logprobs is not None)
        constraint = _constraint(message.structured_output)
        _require(constraint is None or not sampling.ignore_eos,
                 "structured_output and sampling.ignore_eos: the output must end where its grammar does")
        tools = _tools(message.chat.tools_json) if kind == "chat" and message.chat.tools_json else None
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
            tools=tools,
            constraint=constraint,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            speculative=message.speculative if message.HasField("speculative") else None,
        )


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability and the most likely tokens at its position: [(id, logprob)],
    most likely first. logprob is None only for a prompt's first token."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """New tokens and text since the previous output; finish_reason is set on the last one only."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """stop | length | aborted"""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per token id, when the request asked for logprobs."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """One per prompt token, on the first output, when the request asked for them."""

    def fields(self) -> tuple:
        """Its fields in order, as plain values: RequestOutput(*fields) is the same output. An engine
        in its own process sends one a row a step (hosted.py), and its loop pickles them while the
        engine thread waits for the interpreter lock: 256 of them took 258 us pickled as objects and
        38 us as these tuples (a 2-core Xeon)."""
        return self.text, self.token_ids, self.finish_reason, self.logprobs, self.prompt_logprobs

    def merge(self, later: RequestOutput) -> None:
        """Folds a later delta into this one, for a consumer that fell behind the engine."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finish_reason = later.finish_reason


def _chat_message(index: int, m: pb.ChatMessage) -> ChatMessage:
    where = f"chat.messages[{index}]"
    _require(m.role in CHAT_ROLES, f"{where}.role {m.role!r} is not one of {', '.join(sorted(CHAT_ROLES))}")
    calls = []
    for number, call in enumerate(m.tool_calls):
        _require(m.role == "assistant", f"{where}.tool_calls: only assistant messages make tool calls")
        _require(call.name != "", f"{where}.tool_calls[{number}].name is empty")
        _require(isinstance(_json(call.arguments or "{}", f"{where}.tool_calls[{number}].arguments"), dict),
                 f"{where}.tool_calls[{number}].arguments must be a JSON object")
        calls.append(ToolCall(call.id, call.name, call.arguments or "{}"))
    _require(not m.tool_call_id or m.role == "tool", f"{where}.tool_call_id: only tool messages answer a call")
    return ChatMessage(m.role, m.content, tuple(calls), m.tool_call_id, m.name)


def _count(message: pb.PredictRequest, name: str) -> int | None:
    if not message.HasField(name):
        return None
    value = getattr(message, name)
    _require(value <= MAX_LOGPROBS, f"{name} must be 0 to {MAX_LOGPROBS}")
    return value


def _constraint(structured: pb.StructuredOutput) -> Constraint | None:
    kind = structured.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not structured.json_object):
        return None
    if kind == "json_object":
        return Constraint(kind, "")
    if kind == "choice":
        choices = list(structured.choice.choices)
        _require(0 < len(choices) <= MAX_CHOICES, f"structured_output.choice holds 1 to {MAX_CHOICES} strings")
        _require(all(choices), "structured_output.choice: a choice is empty")
        return Constraint(kind, json.dumps(choices))
    spec = getattr(structured, kind)
    _require(spec.strip() != "", f"structured_output.{kind} is empty")
    if kind == "json_schema":
        _require(isinstance(_json(spec, "structured_output.json_schema"), (dict, bool)),
                 "structured_output.json_schema must be a JSON object")
    return Constraint(kind, spec)


def _tools(text: str) -> list[dict]:
    tools = _json(text, "chat.tools_json")
    _require(isinstance(tools, list) and 0 < len(tools) <= MAX_TOOLS,
             f"chat.tools_json must be a JSON array of 1 to {MAX_TOOLS} tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        _require(isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                 and isinstance(function.get("name"), str) and function["name"] != "",
                 f'chat.tools_json[{index}] must be {{"type": "function", "function": {{"name": ...}}}}')
        _require(isinstance(function.get("parameters", {}), dict),
                 f"chat.tools_json[{index}].function.parameters must be a JSON Schema object")
    return tools


def _json(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{where} is not valid JSON: {exc}") from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequest(message)


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))

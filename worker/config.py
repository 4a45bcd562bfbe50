"""The worker's one configuration object: its sections, their defaults and their validation."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

SOCKET_PATH_MAX_BYTES = 107  # sun_path is 108 bytes including the terminating NUL
EMBEDDED_MODEL = "smollm2-135m-instruct"


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the dotted key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key

    def __reduce__(self):  # so it crosses from an engine's own process (hosted.py) as itself
        return ConfigError, (self.key, str(self)[len(self.key) + 2:])


@dataclass
class ServerConfig:
    socket: str = ""
    """Unix socket path; its directory is created 0750 and the socket is 0660."""
    drain_timeout_s: float = 30.0
    """On SIGTERM/Drain, how long in-flight streams may run on before they end UNAVAILABLE."""
    max_receive_message_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"
    max_messages_per_s: float = 10_000.0
    """Response messages per second over all streams; each stream's messages are spaced by
    running streams / this, and tokens produced meanwhile ride in the next message (the native
    engine spaces them where it makes them; a first token and a last one go at once). Leaves the
    event loop room to accept new calls under load. 0 sends as fast as the transport takes them."""
    min_message_interval_s: float = 0.005
    """The shortest time between two messages of one stream, however few run: a small model's ~1 ms
    GPU steps would otherwise be a message each, whose work on the event loop holds the interpreter
    lock the engine thread needs. The native engine sends a first and a last token at once; with
    the other engines (spaced by the servicer) a last token may wait out the interval. 0: only
    max_messages_per_s spaces them."""
    progress_timeout_s: float = 20.0
    """While requests run and the engine completed no step (a prefill chunk or a decode) and sent
    no output for this long, the inference service reports NOT_SERVING (liveness stays up) until
    it moves again; 0 turns the check off."""
    max_consecutive_engine_errors: int = 5
    """Device or engine faults in a row (out of memory, a failed request) after which the worker
    stops serving and exits non-zero so it is restarted; a success resets the count."""
    exit_with_parent: bool = False
    """Exit when the process that started the worker dies (sidecar, container init)."""
    stall_timeout_s: float = 60.0
    """A stream whose client takes no message for this long (HTTP/2 flow control holding the
    worker's writes) ends RESOURCE_EXHAUSTED and its slot is freed; 0 waits for ever."""
    exit_on_load_failure: bool = True
    """A model that fails to load stops the worker (exit code 3, so a supervisor restarts it);
    false keeps it alive and never ready, answering UNAVAILABLE with the load error."""
    keepalive_min_ping_interval_s: float = 5.0
    """The shortest spacing of HTTP/2 keepalive pings a client may send, with or without data
    on the connection (grpc's `grpc.http2.min_ping_interval_without_data_ms`). A client that
    pings more often collects strikes and, past keepalive_max_ping_strikes, its connection is
    closed with every stream on it: grpc's default of 5 minutes killed the sidecar's streams (it
    pings every 10 s) after a minute without output. Clients must ping no more often than this;
    the sidecar reads it from GetInfo and refuses a worker it would strike against."""
    keepalive_permit_without_calls: bool = True
    """Accept pings on a connection with no call open (the sidecar pings idle connections too,
    so that a hung worker is noticed before a request is sent to it)."""
    keepalive_max_ping_strikes: int = 2
    """Pings closer together than keepalive_min_ping_interval_s tolerated before the connection
    is closed (GOAWAY too_many_pings); 0 tolerates any number."""

    def grpc_options(self) -> list[tuple[str, int]]:
        """grpc server options: the message size and the keepalive policy above."""
        return [
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            ("grpc.http2.min_ping_interval_without_data_ms", int(self.keepalive_min_ping_interval_s * 1000)),
            ("grpc.keepalive_permit_without_calls", int(self.keepalive_permit_without_calls)),
            ("grpc.http2.max_ping_strikes", self.keepalive_max_ping_strikes),
        ]

    def validate(self) -> None:
        if not self.socket:
            raise ConfigError("server.socket", "must be set")
        if len(os.fsencode(self.socket)) > SOCKET_PATH_MAX_BYTES:
            raise ConfigError(
                "server.socket",
                f"path is {len(os.fsencode(self.socket))} bytes, over the {SOCKET_PATH_MAX_BYTES}-byte "
                "limit of a Unix socket path; choose a shorter one",
            )
        _check_range("server.drain_timeout_s", self.drain_timeout_s, 0, 3600)
        _check_range("server.max_consecutive_engine_errors", self.max_consecutive_engine_errors, 1, 1_000_000)
        _check_range("server.progress_timeout_s", self.progress_timeout_s, 0, 86_400)
        _check_range("server.stall_timeout_s", self.stall_timeout_s, 0, 86_400)
        _check_range("server.max_messages_per_s", self.max_messages_per_s, 0, 1e9)
        _check_range("server.min_message_interval_s", self.min_message_interval_s, 0, 10)
        _check_range("server.max_receive_message_bytes", self.max_receive_message_bytes, 1024, 1 << 30)
        _check_range("server.keepalive_min_ping_interval_s", self.keepalive_min_ping_interval_s, 0.0, 86_400.0)
        _check_range("server.keepalive_max_ping_strikes", self.keepalive_max_ping_strikes, 0, 1_000_000)
        if self.log_level.lower() not in {"debug", "info", "warning", "error"}:
            raise ConfigError("server.log_level", f"{self.log_level!r} is not debug|info|warning|error")


@dataclass
class EngineConfig:
    name: str = "native"
    """Engine from the factory: native | transformers | vllm | trtllm | synthetic."""
    model: str = EMBEDDED_MODEL
    """A local HF folder, or the name of the embedded model (prepared on first use)."""
    served_name: str = ""
    """The name requests use in `model`; defaults to the model's folder or alias name."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16; auto is float32 on CPU and bfloat16 on CUDA."""
    max_model_len: int = 0
    """Context limit in tokens; 0 takes the model's own."""
    args: dict[str, Any] = field(default_factory=dict)
    """Engine-specific arguments, passed through to the engine and checked there."""
    kernel_dir: str = ""
    """Where the native engine compiles its CPU kernels (once per torch version, CPU model,
    instruction set and source); empty: none are built and its plain torch paths run."""
    cpu_isa: str = "auto"
    """auto | avx512 | avx2 | neon | default: the instruction set of the CPU engines' kernels (native's
    C++ ones, oneDNN's linear layers, torch's own, vLLM's); auto is the CPU's best. One below it
    runs what an older CPU would (avx2 on an AVX-512 machine measures and tests the AVX2 paths)."""
    use_preset: bool = True
    """Apply the dependency registry's preset for the detected (hardware, engine) to whatever
    this config leaves unset."""
    own_process: str = "auto"
    """auto | true | false: the engine (native, transformers, synthetic) in a process of its own,
    the worker's keeping gRPC, admission and tokenizing, so the engine's host work no longer
    shares one interpreter lock with theirs (docs/architecture.md). auto: native on CUDA (on an
    H100, 1.1-1.3x the tokens/s of the embedded model; on a 2-core CPU the two processes only
    contend for the cores). vLLM and TensorRT-LLM run their engine cores in processes of their own."""

    def validate(self) -> None:
        if not self.name:
            raise ConfigError("engine.name", "must be set")
        if not self.model:
            raise ConfigError("engine.model", "must be set")
        if self.dtype not in {"auto", "float32", "bfloat16", "float16"}:
            raise ConfigError("engine.dtype", f"{self.dtype!r} is not auto|float32|bfloat16|float16")
        if self.cpu_isa not in {"auto", "avx512", "avx2", "neon", "default"}:
            raise ConfigError("engine.cpu_isa", f"{self.cpu_isa!r} is not auto|avx512|avx2|neon|default")
        if not (self.device in {"auto", "cpu", "cuda"} or self.device.startswith("cuda:")):
            raise ConfigError("engine.device", f"{self.device!r} is not auto|cpu|cuda|cuda:N")
        _check_range("engine.max_model_len", self.max_model_len, 0, 10_000_000)
        if not isinstance(self.args, dict):
            raise ConfigError("engine.args", "must be a mapping")
        self.own_process = str(self.own_process).lower()
        if self.own_process not in {"auto", "true", "false"}:
            raise ConfigError("engine.own_process", f"{self.own_process!r} is not auto|true|false")
        if self.own_process == "true" and self.name in {"vllm", "trtllm"}:
            raise ConfigError("engine.own_process", f"the {self.name} engine runs its engine core in a process of "
                              "its own already; leave own_process auto or false")


@dataclass
class SamplingDefaults:
    """Applied to every request field the client left unset."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    max_tokens: int = 512

    def validate(self) -> None:
        _check_range("sampling.temperature", self.temperature, 0.0, 2.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("sampling.top_p", f"{self.top_p} is outside (0, 1]")
        _check_range("sampling.top_k", self.top_k, 0, 1_000_000)
        _check_range("sampling.max_tokens", self.max_tokens, 1, 1_000_000)


@dataclass
class ResourceConfig:
    max_concurrency: int = 8
    """Requests running in the engine at once."""
    max_queue: int = 256
    """Requests waiting for admission; beyond it RESOURCE_EXHAUSTED at once."""
    queue_timeout_s: float = 30.0
    """How long a request may wait for a slot and budget."""
    budget_tokens: int = 0
    """KV budget in tokens (prompt + max_tokens of every running request); 0 takes the engine's."""
    memory_limit_gib: float = 0.0
    """For engines that cannot size their KV cache: memory for weights + KV; 0 picks a default."""

    def validate(self) -> None:
        _check_range("resources.max_concurrency", self.max_concurrency, 1, 100_000)
        _check_range("resources.max_queue", self.max_queue, 0, 1_000_000)
        _check_range("resources.queue_timeout_s", self.queue_timeout_s, 0.0, 86_400.0)
        _check_range("resources.budget_tokens", self.budget_tokens, 0, 1 << 40)
        _check_range("resources.memory_limit_gib", self.memory_limit_gib, 0.0, 1 << 20)


@dataclass
class ModelsConfig:
    cache_dir: str = ""
    """Where prepared models (converted HF folders) live, outside any checkout."""

    def validate(self) -> None:
        if not self.cache_dir:
            raise ConfigError("models.cache_dir", "must be set")


@dataclass
class AdaptersConfig:
    kb_dir: str = ""
    """Where `cy-llm kb index` writes knowledge bases (NAME.sqlite) and rag adapters find them."""
    named: dict[str, Any] = field(default_factory=dict)
    """name -> {type: rag, kb: NAME, top_k: 3, max_context_tokens: 512} or
    {type: system_prompt, text: ..., template: "{system}\n\n{prompt}", replace: false}."""

    def validate(self) -> None:
        """The specs themselves are checked where the worker builds its adapters
        (worker.adapters.base.build_adapters), with the same errors naming the key."""
        if not self.kb_dir:
            raise ConfigError("adapters.kb_dir", "must be set")


@dataclass
class TenantsConfig:
    key: str = "x-gateway-inference-fairness-id"
    """PredictRequest.metadata key naming the tenant (the sidecar puts the gateway's fairness
    header, or the API key's name, there); `default` when absent."""
    policy: str = "vtc"
    """vtc: the waiting request of the least served tenant goes first (fairness.py); fcfs: arrival order."""
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    """What a prompt and a generated token add to a tenant's service (VTC's w_p and w_q)."""
    named: dict[str, Any] = field(default_factory=dict)
    """name (or `default`, for all others) -> {weight: 1.0, max_concurrency: 0 (no cap), max_budget_share: 1.0}."""
    metric_tenants: int = 20
    """Tenants labelled by name in metrics besides the named ones (first seen); the rest are `other`."""
    headroom_slots: int = 0
    """Slots kept for tenants holding few: the last N free slots go only to a tenant running fewer
    than max_concurrency / (tenants seen within recent_s), so a light tenant's request starts at
    once while a flood holds the rest (admission cannot preempt). Costs the flood up to N slots
    while a light tenant is between requests; none when it runs alone or everyone is backlogged."""
    burst_slots: int = 0
    """Slots above max_concurrency for tenants holding few (the headroom's test): a light tenant's
    request starts while fewer than max_concurrency + N run, others' only below max_concurrency, so
    a flood keeps every slot while light tenants are away. The engine runs up to max_concurrency +
    N requests: its max_num_seqs must allow that (a registry preset sizes it so)."""
    recent_s: float = 30.0
    """How long a tenant counts toward the headroom's and burst's shares after its last request."""

    def validate(self) -> None:
        from worker.fairness import POLICIES, parse_limits

        if not self.key:
            raise ConfigError("tenants.key", "must be set")
        if self.policy not in POLICIES:
            raise ConfigError("tenants.policy", f"one of {', '.join(POLICIES)}")
        for key in ("prompt_weight", "output_weight", "metric_tenants", "headroom_slots", "burst_slots", "recent_s"):
            _check_range(f"tenants.{key}", getattr(self, key), 0, 1e6)
        for name, spec in self.named.items():
            try:
                parse_limits(f"tenants.named.{name}", spec)
            except ValueError as exc:
                raise ConfigError(*str(exc).split(": ", 1)) from None


SAMPLERS = ("parentbased_traceidratio", "traceidratio", "parentbased_always_on", "always_on",
            "parentbased_always_off", "always_off")


@dataclass
class TracingConfig:
    otlp_endpoint: str = ""
    """OTLP/gRPC collector for traces (http://HOST:4317); traces are off without one."""
    sampler: str = "parentbased_traceidratio"
    """OTEL_TRACES_SAMPLER's names; the parent-based ones follow the sidecar's decision."""
    sample_ratio: float = 1.0
    """Fraction of new traces recorded, for the ratio samplers."""
    service_name: str = "cy-llm-worker"
    export_timeout_s: float = 10.0
    """How long one export may take before its spans are dropped (and counted)."""

    def validate(self) -> None:
        if self.otlp_endpoint and not self.otlp_endpoint.startswith("http://"):
            raise ConfigError("tracing.otlp_endpoint", "OTLP over gRPC in plain text: http://HOST:4317")
        if self.sampler not in SAMPLERS:
            raise ConfigError("tracing.sampler", f"one of {', '.join(SAMPLERS)}")
        _check_range("tracing.sample_ratio", self.sample_ratio, 0.0, 1.0)
        _check_range("tracing.export_timeout_s", self.export_timeout_s, 0.1, 600.0)


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    explicit_keys: frozenset[str] = frozenset()
    """Dotted keys set by the YAML file, the environment or flags (not defaults)."""

    def validate(self) -> Config:
        for section in (self.server, self.engine, self.sampling, self.resources, self.models, self.adapters,
                        self.tracing, self.tenants):
            section.validate()
        return self


def _check_range(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(key, f"{value} is outside [{low}, {high}]")

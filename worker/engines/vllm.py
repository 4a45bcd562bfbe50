"""vllm engine: vLLM's v1 AsyncLLM, streaming DELTA outputs; the KV budget is its blocks x block size.

Prompts are tokenized here with the model's own tokenizer (so admission counts the same tokens the
engine sees) and handed to vLLM as token ids. vLLM's KV-cache events (its ZMQ publisher, on an ipc
socket of this worker's) are followed and re-published as ours (vllm_events.py), unless the engine
arguments set kv_events_config themselves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import shutil
import tempfile
import time
from typing import Any

from worker.config import ConfigError
from worker.engines import vllm_events
from worker.engines.base import BaseEngine, ModelInfo, RequestStream
from worker.engines.cache_events import CacheEvents
from worker.engines.logprobs import from_ranked
from worker.engines.prompt import encode_prompt
from worker.errors import DeviceOutOfMemory, EngineDead, EngineRequestError, InvalidRequest
from worker.models import locate_model
from worker.request import GenerationRequest, RequestOutput
from worker.telemetry import get_logger

log = get_logger(__name__)
GIB = 1 << 30
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "aborted"}
# Ours, not AsyncEngineArgs fields.
OWN_ARGS = {"multiprocessing"}


class VLLMEngine(BaseEngine):
    name = "vllm"
    preset_args = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype",
                   "quantization", "block_size")

    def __init__(self, config, on_fatal=None):
        super().__init__(config, on_fatal)
        from vllm.engine.arg_utils import AsyncEngineArgs

        fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        for key in config.engine.args:
            if key not in fields and key not in OWN_ARGS:
                raise ConfigError(f"engine.args.{key}", "not an argument of vLLM's AsyncEngineArgs")
        self.engine = None
        self._budget = 0
        self._ids = itertools.count()
        self._requests: dict[int, tuple[str, asyncio.Task]] = {}
        # vLLM's event publisher binds here; None when the arguments configure the events.
        self._events_dir = None if "kv_events_config" in config.engine.args else tempfile.mkdtemp(prefix="cyllm-kv-")
        self._events_task: asyncio.Task | None = None
        self._prefix_stats = [0, 0]  # prompt tokens looked up in vLLM's prefix cache, and found (its step stats)

    def _engine_args(self, folder: str) -> Any:
        from vllm.config import KVEventsConfig, StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        engine = self.config.engine
        args = {k: v for k, v in engine.args.items() if k not in OWN_ARGS}
        on_cpu = engine.device == "cpu" or (engine.device == "auto" and not _cuda_available())
        defaults: dict[str, Any] = {
            "model": folder,
            "served_model_name": engine.served_name or _served_name(engine.model, folder),
            "dtype": engine.dtype if engine.dtype != "auto" else ("float32" if on_cpu else "auto"),
            "disable_log_stats": True,
            # xgrammar and compact JSON, as the other engines: "auto" hands schemas with keywords it
            # reads as unsupported (maxLength) to llguidance, which then emits free whitespace.
            "structured_outputs_config": StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
        }
        if engine.max_model_len:
            defaults["max_model_len"] = engine.max_model_len
        if self._events_dir:
            defaults["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{self._events_dir}/events",
                replay_endpoint=f"ipc://{self._events_dir}/replay")
        if on_cpu:
            # No graph capture, the model in the engine core's process (load_model): ready in
            # seconds on a CPU host.
            defaults.update(enforce_eager=True, distributed_executor_backend="uni",
                            kv_cache_memory_bytes=int((self.config.resources.memory_limit_gib or 2) * GIB))
        try:
            return AsyncEngineArgs(**{**defaults, **args})
        except (TypeError, ValueError) as exc:
            raise ConfigError("engine.args", f"vLLM refused the engine arguments: {exc}") from exc

    async def load_model(self) -> ModelInfo:
        # vLLM reads this only from the environment. AsyncLLM runs its engine core in a process of
        # its own either way; on CPUs, 0 keeps the model there (the "uni" executor above), where 1
        # (engine.args.multiprocessing) has vLLM's CPU platform start another process for it: one
        # more process of the model's size, ready in 48 s against 30 on 2 cores. On GPUs only a
        # warning of vLLM 0.32's reads it.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.config.engine.args.get("multiprocessing") else "0"
        isa = self.config.engine.cpu_isa
        if isa not in ("auto", "avx512", "avx2"):
            raise ConfigError("engine.cpu_isa", f"vLLM's CPU kernels are built for avx512 and avx2, not {isa}")
        if isa == "avx2":
            # vLLM picks its kernel library (_C or _C_AVX2) from torch's AVX-512 probe, which no
            # setting reaches: answered here, before vLLM imports it.
            import torch.cpu

            torch.cpu._is_avx512_supported = lambda: False
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        folder = await asyncio.to_thread(locate_model, self.config.engine.model, self.config.models.cache_dir,
                                         True, lambda m: log.info(m))
        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, folder)
        engine_args = self._engine_args(str(folder))
        self.engine = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args,
                                              stat_loggers=[_step_clock(self)])
        vllm_config = self.engine.vllm_config
        cache, model = vllm_config.cache_config, vllm_config.model_config
        # The same compiler vLLM's default backend runs: a malformed constraint is refused before admission.
        await asyncio.to_thread(self._load_grammars, model.get_vocab_size(), frozenset({self.tokenizer.eos_token_id} - {None}))
        self._budget = int(cache.num_gpu_blocks) * int(cache.block_size)
        if self._events_dir:
            self.events = CacheEvents(int(cache.block_size))
            self._events_task = asyncio.create_task(vllm_events.follow(
                f"ipc://{self._events_dir}/events", f"ipc://{self._events_dir}/replay", self.events), name="vllm-kv-events")
        self.info = ModelInfo(
            served_name=engine_args.served_model_name if isinstance(engine_args.served_model_name, str)
            else engine_args.served_model_name[0],
            max_model_len=model.max_model_len,
            vocab_size=max(model.get_vocab_size(), len(self.tokenizer)),
            kv_bytes_per_token=0,
        )
        log.info("vllm engine ready", folder=str(folder), kv_blocks=cache.num_gpu_blocks, block_size=cache.block_size,
                 budget_tokens=self._budget, dtype=str(model.dtype))
        return self.info

    async def unload_model(self) -> None:
        for _key, task in list(self._requests.values()):
            task.cancel()
        if self._events_task is not None:
            self._events_task.cancel()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._events_dir:
            shutil.rmtree(self._events_dir, ignore_errors=True)

    def kv_budget_tokens(self) -> int:
        return self._budget

    async def warmup(self) -> None:
        await super().warmup()
        # vLLM records a step's stats before its outputs reach a stream: the warm-up's are all in.
        self._prefix_stats = [0, 0]  # its requests (the worker's among them) are not the service's

    def prefix_cache_stats(self) -> tuple[int, int] | None:
        return (self._prefix_stats[0], self._prefix_stats[1]) if self.engine is not None else None

    def num_unfinished(self) -> int:
        if self.engine is None:
            return 0
        return self.engine.output_processor.get_num_unfinished_requests()

    def get_memory_usage(self) -> dict[str, int]:
        if _cuda_available():
            import torch

            return {f"cuda:{i}": torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())}
        with open("/proc/self/statm") as statm:
            return {"cpu": int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")}

    def encode(self, request: GenerationRequest) -> list[int]:
        return encode_prompt(self.tokenizer, request)

    def stream_predict(self, request: GenerationRequest) -> RequestStream:
        stream = RequestStream(request.request_id)
        # vLLM needs ids unique among running requests; clients may reuse theirs.
        key = f"{request.request_id}-{next(self._ids)}"
        task = asyncio.get_running_loop().create_task(self._pump(key, request, stream))
        self._requests[id(stream)] = (key, task)
        return stream

    def abort(self, stream: RequestStream) -> None:
        entry = self._requests.pop(id(stream), None)
        if entry is not None:
            # A cancelled reader makes AsyncLLM.generate abort the request in the engine.
            entry[1].cancel()

    async def _pump(self, key: str, request: GenerationRequest, stream: RequestStream) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            params = self._sampling_params(request)
            async for output in self.engine.generate(TokensPrompt(prompt_token_ids=request.prompt_token_ids),
                                                     params, key, priority=0):
                completion = output.outputs[0]
                finish = FINISH_REASONS.get(completion.finish_reason) if output.finished else None
                stream.put(RequestOutput(
                    text=completion.text, token_ids=list(completion.token_ids), finish_reason=finish,
                    logprobs=from_ranked(completion.token_ids, completion.logprobs, request.logprobs),
                    prompt_logprobs=from_ranked(request.prompt_token_ids, output.prompt_logprobs, request.prompt_logprobs)
                    if output.prompt_logprobs is not None else None))
                if output.finished:
                    break
        except EngineDeadError as exc:
            stream.fail(EngineDead("vLLM engine died"))
            self._on_fatal(exc)
        except ValueError as exc:
            stream.fail(InvalidRequest(str(exc)))
        except Exception as exc:  # noqa: BLE001 - one request's fault
            if type(exc).__name__ == "OutOfMemoryError":
                stream.fail(DeviceOutOfMemory("device out of memory on this request"))
            else:
                log.error("vllm request failed", request_id=request.request_id, error=repr(exc))
                stream.fail(EngineRequestError("engine error on this request"))
        finally:
            self._requests.pop(id(stream), None)

    def _sampling_params(self, request: GenerationRequest) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        s, constraint = request.sampling, request.constraint
        structured = None
        if constraint is not None:
            # Compact JSON, as the native and transformers engines make it.
            value = {"json_schema": constraint.spec, "json_object": True, "regex": constraint.spec,
                     "grammar": constraint.spec, "choice": json.loads(constraint.spec) if constraint.kind == "choice"
                     else None}[constraint.kind]
            key = {"json_schema": "json"}.get(constraint.kind, constraint.kind)
            structured = StructuredOutputsParams(**{key: value}, disable_any_whitespace=True)
        return SamplingParams(
            n=1, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids),
            seed=s.seed, ignore_eos=s.ignore_eos, output_kind=RequestOutputKind.DELTA, skip_special_tokens=True,
            structured_outputs=structured, logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs)


def _step_clock(engine: VLLMEngine) -> Any:
    """A vLLM stat logger that only keeps the time of the engine's last step and sums its prefix
    cache's lookups: vLLM calls record() once per step, prefill chunks included (it sends the
    scheduler's stats even for a step with no output), which is what the progress watchdog needs
    while a long prompt produces nothing. vLLM's own loggers stay off."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepClock(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
            engine.last_step_at = time.monotonic()
            if scheduler_stats is not None and (prefix := scheduler_stats.prefix_cache_stats) is not None:
                engine._prefix_stats[0] += prefix.queries
                engine._prefix_stats[1] += prefix.hits

        def log_engine_initialized(self) -> None:
            pass

    return StepClock


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _served_name(spec: str, folder) -> str:
    return spec if os.sep not in spec else os.path.basename(str(folder).rstrip(os.sep))

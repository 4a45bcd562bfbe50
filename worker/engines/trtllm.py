"""trtllm engine: TensorRT-LLM's LLM API (`tensorrt_llm.LLM`, `generate_async(streaming=True)`).

Written against tensorrt_llm 1.2 (the registry's pin). Prompts are tokenized here with the model's
own tokenizer and sent as token ids; the KV budget is the executor's max KV blocks x tokens per block.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from worker.config import ConfigError
from worker.engines.base import BaseEngine, ModelInfo, RequestStream
from worker.engines.grammar import choice_grammar
from worker.engines.logprobs import from_ranked
from worker.engines.prompt import encode_prompt
from worker.errors import DeviceOutOfMemory, EngineDead, EngineRequestError, InvalidRequest
from worker.models import locate_model
from worker.request import GenerationRequest, RequestOutput
from worker.telemetry import get_logger

log = get_logger(__name__)
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "aborted", "abort": "aborted"}
# Arguments of tensorrt_llm.LLM this engine sets itself or understands (the rest pass through).
KV_ARGS = ("gpu_memory_utilization", "kv_cache_dtype", "block_size")


class TRTLLMEngine(BaseEngine):
    name = "trtllm"
    preset_args = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "block_size")

    def __init__(self, config, on_fatal=None):
        super().__init__(config, on_fatal)
        import tensorrt_llm  # noqa: F401 - fail at build time, with the factory's install hint

        self.llm = None
        self._budget = 0
        self._requests: dict[int, tuple[Any, asyncio.Task]] = {}

    def _llm_args(self, folder: str) -> dict[str, Any]:
        from tensorrt_llm.llmapi import KvCacheConfig

        args = dict(self.config.engine.args)
        kv = {"free_gpu_memory_fraction": args.pop("gpu_memory_utilization", 0.9)}
        if (dtype := args.pop("kv_cache_dtype", "auto")) != "auto":
            kv["dtype"] = dtype
        tokens_per_block = args.pop("block_size", None)
        # xgrammar, as the native and vLLM engines use: it takes json, regex and EBNF grammars.
        llm_args: dict[str, Any] = {"model": folder, "kv_cache_config": KvCacheConfig(**kv),
                                    "guided_decoding_backend": "xgrammar"}
        if tokens_per_block:
            llm_args["tokens_per_block"] = tokens_per_block
        if "max_num_seqs" in args:
            llm_args["max_batch_size"] = args.pop("max_num_seqs")
        if "max_num_batched_tokens" in args:
            llm_args["max_num_tokens"] = args.pop("max_num_batched_tokens")
        if self.config.engine.max_model_len:
            llm_args["max_seq_len"] = self.config.engine.max_model_len
        if self.config.engine.dtype != "auto":
            llm_args["dtype"] = self.config.engine.dtype
        return {**llm_args, **args}

    async def load_model(self) -> ModelInfo:
        from tensorrt_llm import LLM
        from transformers import AutoTokenizer

        folder = await asyncio.to_thread(locate_model, self.config.engine.model, self.config.models.cache_dir,
                                         True, lambda m: log.info(m))
        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, folder)
        try:
            self.llm = await asyncio.to_thread(LLM, **self._llm_args(str(folder)))
        except TypeError as exc:
            raise ConfigError("engine.args", f"TensorRT-LLM refused the arguments: {exc}") from exc
        await asyncio.to_thread(self._load_grammars, len(self.tokenizer),
                                frozenset({self.tokenizer.eos_token_id} - {None}))
        stats = await asyncio.to_thread(self._kv_stats)
        self._budget = stats["maxNumBlocks"] * stats["tokensPerBlock"]
        engine = self.config.engine
        self.info = ModelInfo(
            served_name=engine.served_name or (engine.model if os.sep not in engine.model else folder.name),
            max_model_len=engine.max_model_len or self.llm.args.max_seq_len,
            vocab_size=len(self.tokenizer),
            kv_bytes_per_token=0,
        )
        log.info("trtllm engine ready", folder=str(folder), kv_blocks=stats["maxNumBlocks"],
                 block_size=stats["tokensPerBlock"], budget_tokens=self._budget)
        return self.info

    def _kv_stats(self) -> dict[str, int]:
        """The executor reports its KV pool in iteration stats: run one token to get a first one."""
        from tensorrt_llm import SamplingParams

        self.llm.generate([[self.tokenizer.eos_token_id or 0]], SamplingParams(max_tokens=1))
        for stats in self.llm.get_stats(timeout=5):
            kv = stats.get("kvCacheStats") if isinstance(stats, dict) else None
            if kv and kv.get("maxNumBlocks"):
                return kv
        raise RuntimeError("TensorRT-LLM reported no KV cache stats")

    async def unload_model(self) -> None:
        for result, task in list(self._requests.values()):
            result.abort()
            task.cancel()
        if self.llm is not None:
            await asyncio.to_thread(self.llm.shutdown)
            self.llm = None

    def kv_budget_tokens(self) -> int:
        return self._budget

    def num_unfinished(self) -> int:
        return len(self._requests)

    def encode(self, request: GenerationRequest) -> list[int]:
        return encode_prompt(self.tokenizer, request)

    def stream_predict(self, request: GenerationRequest) -> RequestStream:
        from tensorrt_llm import SamplingParams

        stream = RequestStream(request.request_id)
        s = request.sampling
        try:
            params = SamplingParams(
                max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None,
                min_p=s.min_p or None, repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty, stop=list(s.stop) or None,
                stop_token_ids=list(s.stop_token_ids) or None, seed=s.seed, ignore_eos=s.ignore_eos, detokenize=True,
                guided_decoding=_guide(request), logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs)
            result = self.llm.generate_async(request.prompt_token_ids, sampling_params=params, streaming=True)
        except ValueError as exc:
            stream.fail(InvalidRequest(str(exc)))
            return stream
        task = asyncio.get_running_loop().create_task(self._pump(result, request, stream))
        self._requests[id(stream)] = (result, task)
        return stream

    def abort(self, stream: RequestStream) -> None:
        entry = self._requests.pop(id(stream), None)
        if entry is not None:
            result, task = entry
            result.abort()
            task.cancel()

    async def _pump(self, result: Any, request: GenerationRequest, stream: RequestStream) -> None:
        first = True
        try:
            async for output in result:
                completion = output.outputs[0]
                finish = FINISH_REASONS.get(completion.finish_reason) if output.finished else None
                if output.finished and finish is None:
                    finish = "stop"
                prompt = completion.prompt_logprobs if request.prompt_logprobs is not None and first else None
                first = False
                stream.put(RequestOutput(
                    text=completion.text_diff, token_ids=list(completion.token_ids_diff), finish_reason=finish,
                    logprobs=from_ranked(completion.token_ids_diff, completion.logprobs_diff, request.logprobs),
                    prompt_logprobs=from_ranked(request.prompt_token_ids, [None, *prompt], request.prompt_logprobs)
                    if prompt is not None else None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - sorted into the statuses of the design card
            name = type(exc).__name__
            if "OutOfMemory" in name:
                stream.fail(DeviceOutOfMemory("device out of memory on this request"))
            elif name in ("RequestError", "ValueError"):
                stream.fail(InvalidRequest(str(exc)))
            elif name in ("ExecutorError", "EngineDeadError"):
                stream.fail(EngineDead("TensorRT-LLM executor died"))
                self._on_fatal(exc)
            else:
                log.error("trtllm request failed", request_id=request.request_id, error=repr(exc))
                stream.fail(EngineRequestError("engine error on this request"))
        finally:
            self._requests.pop(id(stream), None)


def _guide(request: GenerationRequest) -> Any:
    """TensorRT-LLM's GuidedDecodingParams; a choice becomes an EBNF grammar (it has no choice kind)."""
    from tensorrt_llm.llmapi import GuidedDecodingParams

    constraint = request.constraint
    if constraint is None:
        return None
    if constraint.kind == "choice":
        return GuidedDecodingParams(grammar=choice_grammar(constraint.spec))
    if constraint.kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    return GuidedDecodingParams(**{{"json_schema": "json"}.get(constraint.kind, constraint.kind): constraint.spec})

"""transformers engine: a Hugging Face causal LM on CPU or CUDA, one engine thread, requests interleaved per token.

The reference engine: every sampling field honoured, tokens streamed as produced, aborts between
tokens. Requests take turns a token at a time (no batching); the native engine batches.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.config import ConfigError
from worker.engines.base import ModelInfo, RequestStream
from worker.engines.detokenizer import OutputText
from worker.engines.prompt import encode_prompt
from worker.engines.logprobs import of_prompt
from worker.engines.sampler import Draws, Rows, choose, make_generator
from worker.engines.threaded import ThreadedEngine
from worker.errors import DeviceOutOfMemory, EngineRequestError
from worker.models import locate_model
from worker.request import GenerationRequest, RequestOutput, TokenLogprob
from worker.telemetry import get_logger

log = get_logger(__name__)
GIB = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class _Sequence:
    stream: RequestStream
    request: GenerationRequest
    generator: Draws | None
    text: OutputText
    output_ids: list[int] = field(default_factory=list)
    cache: Any = None
    matcher: Any = None


class TransformersEngine(ThreadedEngine):
    name = "transformers"

    def __init__(self, config, on_fatal=None):
        super().__init__(config, on_fatal)
        if config.engine.args:
            raise ConfigError(f"engine.args.{next(iter(config.engine.args))}",
                              "the transformers engine takes no engine arguments")
        self.model = None
        self.device: torch.device | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self._budget = 0
        self._active: dict[int, _Sequence] = {}  # engine thread only
        self._unfinished = 0  # written by the engine thread only

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        engine = self.config.engine
        folder = locate_model(engine.model, self.config.models.cache_dir, log=lambda m: log.info(m))
        if engine.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(engine.device)
        dtype = DTYPES.get(engine.dtype) or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(self.device).eval()
        except ValueError as exc:
            raise ConfigError("engine.model", f"{folder}: {exc}") from exc
        cfg = self.model.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_bytes = cfg.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = frozenset(i for i in [*eos, self.tokenizer.eos_token_id] if i is not None)
        self._load_grammars(cfg.vocab_size, self.eos_ids)
        self.info = ModelInfo(
            served_name=engine.served_name or (engine.model if os.sep not in engine.model else folder.name),
            max_model_len=engine.max_model_len or cfg.max_position_embeddings,
            vocab_size=max(cfg.vocab_size, len(self.tokenizer)),
            kv_bytes_per_token=kv_bytes,
        )
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self._budget = max(0, int((self._memory_limit() - weights) // kv_bytes))
        log.info("model loaded", folder=str(folder), device=str(self.device), dtype=str(dtype).removeprefix("torch."),
                 weights_bytes=weights, kv_bytes_per_token=kv_bytes, budget_tokens=self._budget)

    def _memory_limit(self) -> int:
        configured = self.config.resources.memory_limit_gib
        if configured:
            return int(configured * GIB)
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        return 4 * GIB

    def _release(self) -> None:
        self.model = None
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def kv_budget_tokens(self) -> int:
        return self._budget

    def num_unfinished(self) -> int:
        return self._unfinished

    def get_memory_usage(self) -> dict[str, int]:
        if self.model is None:
            return {}
        if self.device.type == "cuda":
            return {str(self.device): torch.cuda.memory_allocated(self.device)}
        return {"cpu": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    def encode(self, request: GenerationRequest) -> list[int]:
        return encode_prompt(self.tokenizer, request)

    def stream_predict(self, request: GenerationRequest) -> RequestStream:
        if (refused := self._refused(request.request_id)) is not None:
            return refused
        stream = self.make_stream(request.request_id)
        self._inbox.put(("add", _Sequence(
            stream=stream,
            request=request,
            generator=make_generator(request.sampling),
            text=OutputText(self.tokenizer, request.prompt_token_ids, request.sampling.stop, self.eos_ids),
            matcher=self.grammars.matcher(request.grammar) if request.grammar is not None else None,
        )))
        return stream

    # --- engine thread ---

    def _serve(self) -> None:
        while self._take_inbox(block=not self._active):
            for key in list(self._active):
                if self._step(self._active[key]):
                    del self._active[key]
                self.last_step_at = time.monotonic()
            self._unfinished = len(self._active)

    def _open_streams(self) -> list[RequestStream]:
        return [sequence.stream for sequence in self._active.values()]

    def _on_add(self, sequence: _Sequence) -> None:
        self._active[id(sequence.stream)] = sequence
        self._unfinished = len(self._active)

    def _on_abort(self, stream: RequestStream) -> None:
        if self._active.pop(id(stream), None) is not None:
            self._post(stream.put, RequestOutput(finish_reason="aborted"))
        self._unfinished = len(self._active)

    def _step(self, seq: _Sequence) -> bool:
        """Runs one token of a sequence; True when it finished."""
        params = seq.request.sampling
        try:
            with torch.inference_mode():
                last = seq.output_ids[-1:] if seq.cache is not None else seq.request.prompt_token_ids
                input_ids = torch.tensor([last], device=self.device)
                out = self.model(input_ids=input_ids, past_key_values=seq.cache, use_cache=True)
                prompt_logprobs = None
                if seq.cache is None and seq.request.prompt_logprobs is not None:
                    ids = seq.request.prompt_token_ids
                    prompt_logprobs = [TokenLogprob(ids[0], None),
                                       *of_prompt(out.logits[0, :-1], ids[1:], seq.request.prompt_logprobs)]
                seq.cache = out.past_key_values
                tokens, logprobs = choose(out.logits[:, -1, :], Rows([seq]), self.grammars)
                token = tokens.item()
        except torch.OutOfMemoryError:
            seq.cache = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._post(seq.stream.fail, DeviceOutOfMemory("device out of memory on this request"))
            return True
        except Exception as exc:  # noqa: BLE001 - one request's fault; the others go on
            log.error("request failed in the engine", request_id=seq.request.request_id, error=repr(exc))
            self._post(seq.stream.fail, EngineRequestError("engine error on this request"))
            return True
        seq.output_ids.append(token)
        if seq.matcher is not None:
            seq.matcher.accept_token(token)
        at_limit = (len(seq.output_ids) >= params.max_tokens
                    or len(seq.request.prompt_token_ids) + len(seq.output_ids) >= self.info.max_model_len)
        text, finish = seq.text.add(token, params.stop_token_ids, params.ignore_eos, at_limit)
        self._post(seq.stream.put, RequestOutput(text=text, token_ids=[token], finish_reason=finish,
                                                 logprobs=logprobs.read([token]) if logprobs else [],
                                                 prompt_logprobs=prompt_logprobs))
        return finish is not None

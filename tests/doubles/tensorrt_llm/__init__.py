"""TEST DOUBLE of tensorrt_llm 1.2's LLM API: not TensorRT-LLM, and no model runs here.

Mirrors exactly the surface worker/engines/trtllm.py uses (LLM, SamplingParams, llmapi.KvCacheConfig,
llmapi.GuidedDecodingParams, LLM.generate / generate_async(streaming=True) / get_stats / shutdown,
RequestOutput.abort, the outputs' text_diff / token_ids_diff / finish_reason / logprobs_diff /
prompt_logprobs) so the adapter's stream, abort, budget, parameter mapping and error handling are
tested where TensorRT-LLM cannot run. Tokens are deterministic letters; a guide is recorded, not
followed, and logprobs are made-up numbers of the right shape ({token id: Logprob(logprob, rank)}).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

__version__ = "1.2.1-test-double"
EOS = 2
MAX_TOP_K = 1024  # TensorRT-LLM's sampling kernels take top_k up to 1024


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    guided_decoding: object = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be positive")
        if self.top_k is not None and self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k must be at most {MAX_TOP_K}, got {self.top_k}")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    index: int = 0
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs_diff: list[dict[int, Logprob]] = field(default_factory=list)
    # One entry per prompt token after the first.
    prompt_logprobs: list[dict[int, Logprob]] | None = None


def _ranked(token: int, k: int) -> dict[int, Logprob]:
    """The chosen token (rank 1 here) and k alternatives, most likely first."""
    entries = {token: Logprob(-0.5, 1)}
    for rank in range(2, k + 1):
        entries[(token + rank) % 50 + 3] = Logprob(-0.5 * rank, rank)
    return entries


@dataclass
class _Args:
    max_seq_len: int


class RequestOutput:
    """What generate_async returns: an async iterator of itself, one token per step, abortable."""

    def __init__(self, llm: LLM, prompt: list[int], params: SamplingParams):
        self.llm, self.prompt, self.params = llm, prompt, params
        self.outputs = [CompletionOutput()]
        self.finished = False
        self._generated = 0
        self._aborted = False

    def abort(self) -> None:
        # The executor drops the request at once, whether or not anyone reads the stream again.
        self._aborted = True
        self.llm.active.discard(id(self))

    def __aiter__(self):
        self.llm.active.add(id(self))
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            self.llm.active.discard(id(self))
            raise StopAsyncIteration
        await asyncio.sleep(self.llm.step_s)
        if self._aborted:
            self._finish(CompletionOutput(finish_reason="cancelled"))
            return self
        token = (sum(self.prompt) + 31 * self._generated + (self.params.seed or 0)) % 50 + 3
        if self._generated == self.llm.eos_after and not self.params.ignore_eos:
            token = EOS
        self._generated += 1
        reason = None
        if token == EOS or token in (self.params.stop_token_ids or ()):
            reason = "stop"
        elif self._generated >= self.params.max_tokens:
            reason = "length"
        output = CompletionOutput(text_diff="" if token == EOS else chr(97 + token % 26), token_ids_diff=[token],
                                  finish_reason=reason)
        if self.params.logprobs is not None:
            output.logprobs_diff = [_ranked(token, self.params.logprobs)]
        if self.params.prompt_logprobs is not None:
            output.prompt_logprobs = [_ranked(t, self.params.prompt_logprobs) for t in self.prompt[1:]]
        if reason:
            self._finish(output)
        else:
            self.outputs = [output]
        return self

    def _finish(self, output: CompletionOutput) -> None:
        self.outputs = [output]
        self.finished = True
        self.llm.active.discard(id(self))


class LLM:
    def __init__(self, model: str, kv_cache_config=None, tokens_per_block: int | None = None,
                 max_batch_size: int | None = None, max_num_tokens: int | None = None,
                 max_seq_len: int | None = None, dtype: str | None = None,
                 guided_decoding_backend: str | None = None, **kwargs):
        if kwargs:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(kwargs)}")
        self.model, self.kv_cache_config = model, kv_cache_config
        self.tokens_per_block = tokens_per_block or 32
        self.max_batch_size, self.max_num_tokens, self.dtype = max_batch_size, max_num_tokens, dtype
        self.guided_decoding_backend = guided_decoding_backend
        self.requests: list[SamplingParams] = []  # every request's parameters, for the tests
        self.args = _Args(max_seq_len or 8192)
        self.active: set[int] = set()
        self.step_s = 0.002
        self.eos_after = 10_000
        self._iterations = 0
        self.shut_down = False
        LLM.last = self

    def generate(self, inputs, sampling_params: SamplingParams):
        self._iterations += 1
        return [RequestOutput(self, list(prompt), sampling_params) for prompt in inputs]

    def generate_async(self, inputs, sampling_params: SamplingParams, streaming: bool = False) -> RequestOutput:
        assert streaming, "the adapter always streams"
        self.requests.append(sampling_params)
        return RequestOutput(self, list(inputs), sampling_params)

    def get_stats(self, timeout: float = 2) -> list[dict]:
        if not self._iterations:
            return []
        return [{"iter": self._iterations, "kvCacheStats": {"maxNumBlocks": 1000, "freeNumBlocks": 1000,
                                                             "usedNumBlocks": 0, "tokensPerBlock": self.tokens_per_block}}]

    def shutdown(self) -> None:
        self.shut_down = True

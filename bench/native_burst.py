"""A burst of requests at a random-weight Llama through the native engine, as the GPU benches run
it (native_gpu.py, ttft.py, gpu_parts.py): the model shapes, the model saved as an HF folder, the
engine as a bench makes it, and the burst timed, its decode steps read from the streams."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from pathlib import Path

import torch

from bench.gpu_roofline import DecodeProfile
from worker.config_loader import load_config
from worker.engines.base import BaseEngine
from worker.engines.factory import create_engine
from worker.engines.native.engine import NativeEngine
from worker.loadgen import percentile
from worker.request import GenerationRequest, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
}
SHAPES["smollm2-135m"] = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
SHAPES["tiny"] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=True)  # a smoke test


def make_folder(shape: dict, dtype: torch.dtype, folder: Path):
    """A random-weight Llama of `shape` saved as an HF folder; returns the HF model (on the GPU)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**shape, max_position_embeddings=4096, rope_theta=500000.0, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape["vocab_size"])}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t1", unk_token="t0").save_pretrained(folder)
    return model


async def unload(engine: BaseEngine) -> None:
    """The engine unloaded, what hosted.settle froze once it was loaded (the worker's own, which the
    benches call) thawed first: frozen objects are never collected, and the engine's cycles would
    keep its memory. An engine in the bench's process, unfrozen, through 19 bursts of 1-16 tokens
    (H200, 1B shape), met two full collections of 164 and 171 ms, each holding its thread, and two
    32k-token prefills took 299 and 325 ms against 130-141; frozen, the collections took 10 and 16
    ms, the slowest prefill 144."""
    gc.unfreeze()
    await engine.unload_model()


def engine_for(folder: Path, dtype: str, as_worker: bool = False, **args) -> BaseEngine:
    """The native engine in this process (its model and counters at hand, its kernels under this
    process's profiler); `as_worker`: as the worker makes it, on CUDA in its own process."""
    # Plain decoding: speculation (bench/speculation.py) would change what a step is.
    engine_args = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "speculation": "requested", **args}
    config = load_config(None, {"HOME": "/tmp"}, {
        "engine.name": "native", "engine.model": str(folder), "engine.dtype": dtype,
        "engine.args": json.dumps(engine_args)})
    return create_engine(config) if as_worker else NativeEngine(config)


async def run_requests(engine: BaseEngine, prompts: list[list[int]], new_tokens: int,
                       profile: DecodeProfile | None = None) -> dict:
    """All prompts submitted at once; tokens/s over the whole run and TTFT per request. `profile`
    is read from the last first message to the end: the decode steps alone."""
    started = time.perf_counter()
    firsts: list[tuple[float, int]] = []  # per request: (seconds to its first message, tokens in it)

    async def one(index: int, ids: list[int]) -> list[int]:
        request = GenerationRequest(request_id=f"b{index}-{random.random()}", prompt_token_ids=list(ids),
                                    sampling=SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        tokens: list[int] = []
        async for out in engine.stream_predict(request):
            if not tokens:
                firsts.append((time.perf_counter() - started, len(out.token_ids)))
                if profile is not None and len(firsts) == len(prompts):
                    profile.mark()
            tokens.extend(out.token_ids)
        return tokens

    outputs = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    wall = time.perf_counter() - started
    # Every prompt is in by the last first message; from there the batch decodes in lockstep, one
    # step for each token that request had still to come. A first message read late holds several,
    # and counting from it as if it held one made steps look shorter than they were (H200, 1B shape,
    # batch 256: 1.21 ms a step in one run, 2.04-2.07 in the runs beside it).
    ttfts = [at for at, _ in firsts]
    last_first, first_tokens = max(firsts)
    steps = max(1, new_tokens - first_tokens)
    return {"outputs": outputs, "wall_s": wall, "tokens_per_s": sum(map(len, outputs)) / wall,
            "ttft_ms_p50": percentile(ttfts, 50) * 1000, "ttft_ms_p99": percentile(ttfts, 99) * 1000,
            "ttft_ms_max": last_first * 1000, "decode_step_ms": (wall - last_first) / steps * 1000,
            **({"decode_profile": profile.stop(steps)} if profile is not None else {})}

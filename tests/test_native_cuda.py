"""The native engine's CUDA path (these tests skip without a CUDA GPU): steps launched ahead of
their predecessors' tokens and speculation's verify rows. Which decode graph a step runs:
tests/test_cuda_graphs.py; the kernels themselves: tests/test_cuda_kernels.py,
tests/test_cuda_linear.py and tests/test_cuda_residual.py; what the engine thread does not wait for:
tests/test_cuda_waits.py."""

import asyncio

import pytest
import torch

from tests.conftest import record_check_runs
from worker.config_loader import load_config
from worker.engines.native import ahead
from worker.engines.native import engine as engine_module
from worker.engines.native.engine import NativeEngine
from worker.request import GenerationRequest, SamplingParams


@pytest.mark.skipif(not torch.cuda.is_available(), reason="steps are launched ahead on CUDA, through the graphs")
async def test_steps_launched_ahead_end_each_stream_at_its_token(tiny_llama, monkeypatch):
    """On CUDA a decode step is launched before the previous one's tokens reach the host. An end
    found a step late (length, stop id, abort) must still end the stream at the right token, and
    every block must come back. A request that ends by length gives its slot back (on_finish)
    once the step making its last token is launched, before that token reaches its stream."""
    launched = []
    launch_ahead = engine_module.launch_ahead
    monkeypatch.setattr(engine_module, "launch_ahead", lambda engine, step: launched.append(launch_ahead(engine, step)) or launched[-1])
    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                  "engine.dtype": "float32", "engine.device": "cuda",
                                                  "engine.args.speculation": "requested"})
    engine = NativeEngine(config)
    await engine.load_model()
    prompt = list(range(2, 42))

    finished_at_release = []  # each stream's `finished` when its on_finish ran

    async def run(index: int, **sampling) -> list[int]:
        request = GenerationRequest(request_id=f"r{index}-{len(launched)}", prompt_token_ids=prompt[index:],
                                    sampling=SamplingParams(ignore_eos=True, **sampling))
        stream = engine.stream_predict(request)
        stream.on_finish = lambda: finished_at_release.append(stream.finished)
        return [t async for out in stream for t in out.token_ids]

    try:
        alone = await run(0, max_tokens=40)
        # Every step after the prompt's went ahead but after the last token's (none is needed).
        assert len(alone) == 40 and sum(step is not None for step in launched) == 39 and launched[-1] is None
        stop = alone[9]
        assert await run(0, max_tokens=40, stop_token_ids=[stop]) == alone[:alone.index(stop) + 1]
        outputs = await asyncio.gather(*(run(i, max_tokens=n) for i, n in enumerate((1, 2, 17, 33))))
        assert [len(tokens) for tokens in outputs] == [1, 2, 17, 33]
        # By length: before the last token came; the stop id's end is known once its token is read.
        assert finished_at_release == [False, True, False, False, False, False]
        # Rows of ended sequences left out of the steps after theirs: the others' tokens stay theirs.
        for index, tokens in enumerate(outputs):
            assert tokens == (await run(index, max_tokens=33))[:len(tokens)], index
        stream = engine.stream_predict(GenerationRequest(request_id="gone", prompt_token_ids=prompt,
                                                         sampling=SamplingParams(max_tokens=500, ignore_eos=True)))
        received, aborted = 0, False
        async for out in stream:
            received += len(out.token_ids)
            if received >= 5 and not aborted:  # >=: a slow reader gets several tokens in one output
                engine.abort(stream)
                aborted = True
        assert 5 <= received < 500
        # The engine thread drops the sequence before it posts the "aborted" message that ended the loop.
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="steps are launched ahead on CUDA, through the graphs")
async def test_rows_that_need_their_token_on_the_host_are_sampled_after_it_is_read(tiny_llama, monkeypatch):
    """A grammar's mask, penalties and logprobs need a row's last token on the host. Launched ahead,
    such a step's forward pass is queued first and its sampling once that token is read: every
    request must get what it gets from an engine that never launches ahead."""
    import json
    import re

    from worker.request import Constraint

    launched = []
    launch_ahead = engine_module.launch_ahead
    monkeypatch.setattr(engine_module, "launch_ahead", lambda engine, step: launched.append(launch_ahead(engine, step)) or launched[-1])
    prompt = list(range(2, 42))
    kinds = {"grammar": dict(constraint=Constraint("regex", "(t7|t9){3,40}")), "penalty": dict(repetition_penalty=1.5),
             "logprobs": dict(logprobs=3), "seeded": dict(temperature=1.0, seed=7), "plain": {}}

    async def run(overlap: str) -> dict:
        config = load_config(None, {"HOME": "/tmp"}, {
            "engine.name": "native", "engine.model": str(tiny_llama), "engine.dtype": "float32",
            "engine.device": "cuda", "engine.args": json.dumps({"overlap_output": overlap, "speculation": "requested"})})
        engine = NativeEngine(config)
        await engine.load_model()

        async def one(index: int, kind: str) -> tuple[list[int], list[float]]:
            extra = dict(kinds[kind])
            constraint, logprobs = extra.pop("constraint", None), extra.pop("logprobs", None)
            request = GenerationRequest(request_id=f"{kind}-{overlap}", prompt_token_ids=prompt[index:],
                                        sampling=SamplingParams(max_tokens=24, ignore_eos=constraint is None, **extra),
                                        constraint=constraint, logprobs=logprobs)
            engine.prepare(request)
            tokens, values = [], []
            async for out in engine.stream_predict(request):
                tokens += out.token_ids
                values += [entry.logprob for entry in out.logprobs or ()]
            return tokens, values

        try:
            replies = await asyncio.gather(*(one(i, kind) for i, kind in enumerate(kinds)))
            assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
            return dict(zip(kinds, replies))
        finally:
            await engine.unload_model()

    late = await run("true")
    assert sum(step is not None for step in launched) > 10  # steps holding every kind of row went ahead
    launched.clear()
    eager = await run("false")
    assert not any(launched)
    for kind in kinds:
        assert late[kind][0] == eager[kind][0], kind
        assert late[kind][1] == pytest.approx(eager[kind][1], abs=1e-4), kind
    text = "".join(f"t{token}" for token in late["grammar"][0] if token != 1)
    assert re.fullmatch("(t7|t9){3,40}", text), text
    assert len(late["logprobs"][1]) == 24


@pytest.mark.skipif(not torch.cuda.is_available(), reason="speculation's CUDA path: verify rows in the graphs")
@pytest.mark.parametrize("eager", [False, True])
async def test_speculation_gives_the_same_tokens_on_cuda(tiny_llama, eager):
    """Rows with proposals run as decodes through the CUDA graphs (or eagerly): greedy and seeded
    sampled tokens are those of speculation off, alone and batched, and every block comes back."""
    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                  "engine.dtype": "float32", "engine.device": "cuda",
                                                  "engine.args.speculation": "requested",
                                                  "engine.args.enforce_eager": str(eager).lower()})
    engine = NativeEngine(config)
    await engine.load_model()
    prompts = [list(range(2 + i, 42)) * 3 for i in range(4)]  # repeated: the random model copies it at times

    async def run(index: int, on: bool, **sampling) -> list[int]:
        request = GenerationRequest(request_id=f"s{index}-{on}", prompt_token_ids=prompts[index], speculative=on,
                                    sampling=SamplingParams(max_tokens=48, ignore_eos=True, **sampling))
        return [t async for out in engine.stream_predict(request) for t in out.token_ids]

    try:
        for sampling in ({}, {"temperature": 0.8, "top_k": 50, "seed": 5}):
            off = [await run(i, False, **sampling) for i in range(4)]
            assert [await run(i, True, **sampling) for i in range(4)] == off
            assert list(await asyncio.gather(*(run(i, True, **sampling) for i in range(4)))) == off
        assert engine.speculation_stats()[2] > 0, "proposals were accepted"
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-row kernels run on CUDA")
@pytest.mark.parametrize("eager", [False, True])
async def test_one_row_steps_rotate_and_write_inside_the_qkv_projection_with_the_same_tokens(tiny_llama, monkeypatch, eager):
    """A decode step of one row rotates q and k and writes k and v inside its qkv projection's kernel
    (model.Attention.rope_inside), through the graphs or not: greedy and seeded tokens are those of an
    engine without it, and every block comes back."""
    from worker.engines.native import gemv, model

    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                  "engine.dtype": "float32", "engine.device": "cuda",
                                                  "engine.args.enforce_eager": str(eager).lower()})
    monkeypatch.setattr(gemv, "ROPE_INSIDE", {torch.cuda.get_device_name(): 1 << 30})  # on any GPU
    inside, taken, results = model.Attention.rope_inside, [], []

    def spy(self, *args):
        rope = inside(self, *args)
        taken.append(rope is not None)
        return rope

    for rule in (spy, lambda self, *args: None):
        monkeypatch.setattr(model.Attention, "rope_inside", rule)
        engine = NativeEngine(config)
        await engine.load_model()
        try:
            runs = []
            for sampling in ({}, {"temperature": 0.8, "top_k": 50, "seed": 3}):
                request = GenerationRequest(request_id="r", prompt_token_ids=[2 + 7 * i % 500 for i in range(9)],
                                            sampling=SamplingParams(max_tokens=40, ignore_eos=True, **sampling))
                runs.append([t async for out in engine.stream_predict(request) for t in out.token_ids])
            results.append(runs)
            assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
        finally:
            await engine.unload_model()
    assert sum(taken) >= (2 * 2 * 39 if eager else 2)  # each layer of every decode step, or of the one-row graph
    assert results[0] == results[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks are launched ahead through the graphs")
async def test_checks_launched_ahead_give_the_same_tokens_whatever_the_outcome(tiny_llama, monkeypatch):
    """A step of greedy checks has the next check launched before its tokens are read, with a run
    for each outcome (ahead.checks): the whole draft accepted, or a proposal rejected; the run that
    stands is kept, the others dropped. Greedy ids are those of speculation off, alone and batched,
    both outcomes happen, and every block comes back, after an abort mid-speculation too."""
    launched = []
    checks = ahead.checks
    monkeypatch.setattr(ahead, "checks", lambda engine, step: launched.append(checks(engine, step)) or launched[-1])
    runs = record_check_runs(monkeypatch)
    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                  "engine.dtype": "float32", "engine.device": "cuda",
                                                  "engine.args.speculation": "requested"})
    engine = NativeEngine(config)
    await engine.load_model()
    prompts = [list(range(2 + i, 30)) * 4 for i in range(4)]  # repeated: the random model copies it at times

    async def run(index: int, on: bool) -> list[int]:
        request = GenerationRequest(request_id=f"c{index}-{on}", prompt_token_ids=prompts[index], speculative=on,
                                    sampling=SamplingParams(max_tokens=64, ignore_eos=True))
        return [t async for out in engine.stream_predict(request) for t in out.token_ids]

    try:
        off = [await run(i, False) for i in range(4)]
        assert [await run(i, True) for i in range(4)] == off
        assert list(await asyncio.gather(*(run(i, True) for i in range(4)))) == off
        assert sum(step is not None for step in launched) > 8
        assert {(True, True, True), (True, False, True), (False, True, True), (False, False, True)} <= set(runs), \
            "runs kept and dropped: after a whole draft accepted and after a rejection"
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
        # Aborted mid-speculation, with a check launched ahead in flight: every block still comes back.
        before = len(launched)
        stream = engine.stream_predict(GenerationRequest(request_id="gone", prompt_token_ids=prompts[0], speculative=True,
                                                         sampling=SamplingParams(max_tokens=800, ignore_eos=True)))
        received, aborted = 0, False
        async for out in stream:
            received += len(out.token_ids)
            if not aborted and any(step is not None for step in launched[before:]):  # once checks go ahead
                engine.abort(stream)
                aborted = True
        assert received < 800
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles its kernels on CUDA")
async def test_after_the_warm_up_nothing_compiles_in_service(tiny_llama):
    """The warm-up (warmup.py) runs the kinds of step a server meets: after it, prompts of several
    lengths beside decodes, 1 to 5 at once after cached blocks, sampled ones and ones that speculate
    compile no Triton kernel (each variant took 0.25-0.55 s on a fresh host). Kernels that are not
    warmed, tables of an odd width or parts of a packed copy that are not 16 bytes in each make this fail."""
    import random

    import triton

    # Proposals after one matching token: the random model's tokens then find one in its prompts.
    config = load_config(None, {"HOME": "/tmp"}, {"engine.name": "native", "engine.model": str(tiny_llama),
                                                  "engine.dtype": "bfloat16", "engine.device": "cuda",
                                                  "engine.args.speculative_ngram_min": "1"})
    engine = NativeEngine(config)
    await engine.load_model()
    compiled = []
    try:
        await engine.warmup()
        triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name) and False
        rng = random.Random(4)
        shared = [rng.randrange(2, 512) for _ in range(80)]

        decoding = asyncio.Event()  # set at the long request's first token: the rest run beside it

        async def one(ids: list[int], max_tokens: int, speculative: bool | None = None, **sampling) -> None:
            request = GenerationRequest(request_id=f"r{rng.random()}", prompt_token_ids=ids, speculative=speculative,
                                        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
            async for _ in engine.stream_predict(request):
                decoding.set()

        async def beside() -> None:
            await decoding.wait()
            for length in (3, 17, 40, 100, 333):
                await one([rng.randrange(2, 512) for _ in range(length)], 3)
            for count in range(1, 6):
                await asyncio.gather(*(one(shared + [rng.randrange(2, 512) for _ in range(new)], 3)
                                       for new in (2, 9, 20, 33, 70)[:count]))
            await one([5, 6, 7], 4, temperature=0.9, top_p=0.8, seed=3)
            copied = [rng.randrange(2, 512) for _ in range(200)]
            await asyncio.gather(one(copied, 32, speculative=True),
                                 one(copied[1:], 32, speculative=True, temperature=0.9, seed=3))

        await asyncio.gather(one([9, 10, 11], 400), beside())
        assert compiled == []
        assert engine.speculation_stats()[0] > 0, "proposals were checked in service"
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
        await engine.unload_model()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles its kernels on CUDA")
async def test_after_the_warm_up_a_burst_past_the_graphs_compiles_no_lm_head(tiny_model, tmp_path):
    """A burst of prompts too long for the graphs' rows runs eagerly, its step keeping 17-31 rows of
    logits; a vocabulary of 8,192 or more gives the LM head few_rows' wide tiles (on an H200), which
    no other product of the model takes, over a row count no graph has (not a multiple of 16): the
    variant the warm-up's burst compiles (warmup.py). Nothing compiles in service."""
    import random

    import triton
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = 16384
    folder = tiny_model("llama", vocab_size=vocab, bos_token_id=0, eos_token_id=1)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t1", unk_token="t0").save_pretrained(folder)
    config = load_config(None, {"HOME": str(tmp_path)}, {"engine.name": "native", "engine.model": str(folder),
                                                         "engine.dtype": "bfloat16", "engine.device": "cuda"})
    engine = NativeEngine(config)
    await engine.load_model()
    compiled, logit_rows = [], []
    try:
        await engine.warmup()
        triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name) and False
        forward = engine.model.forward  # eager steps only: the graphs replay without calling it

        def counted(batch, k_cache, v_cache):
            logits = forward(batch, k_cache, v_cache)
            logit_rows.append(logits.shape[0])
            return logits

        engine.model.forward = counted
        rng = random.Random(5)

        async def one(index: int) -> None:
            ids = [rng.randrange(2, vocab) for _ in range(60)]
            request = GenerationRequest(request_id=f"burst-{index}", prompt_token_ids=ids,
                                        sampling=SamplingParams(max_tokens=2, ignore_eos=True))
            async for _ in engine.stream_predict(request):
                pass

        await asyncio.gather(*(one(i) for i in range(23)))
        assert any(17 <= rows < 32 for rows in logit_rows), logit_rows  # the step this test is for ran
        assert compiled == []
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
        await engine.unload_model()

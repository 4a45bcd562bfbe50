"""The native engine speculating: on the embedded model (CPU, fp32) the same greedy and seeded sampled
tokens with speculation on and off, every block back after an abort or a deadline in the middle of a
speculating stream, its settings checked, steps launched ahead through a double of the CUDA graphs,
and the CUDA warm-up's speculating requests (rules of the proposer and verifier: test_speculation.py)."""

import asyncio

import pytest

from tests.conftest import record_check_runs
from worker.config import ConfigError
from worker.config_loader import load_config
from worker.engines.native import ahead
from worker.engines.native.engine import NativeEngine
from worker.errors import RequestDeadlineExceeded
from worker.request import ChatMessage, GenerationRequest, SamplingParams

PARAGRAPH = ("Honey bees make honey from the nectar of flowers. A worker bee carries nectar back to the hive in its "
             "honey stomach, where enzymes break its sugars down. Bees then spread the nectar in wax cells and fan "
             "it with their wings until most of the water evaporates, and seal each cell with a cap of wax.")
PROMPTS = ["Fix the spelling and grammar of this paragraph:\n\n" + PARAGRAPH,
           "Write a short poem about autumn.", "What does a compiler do?",
           "Repeat after me: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog."]


def engine_for(embedded_model, **args) -> NativeEngine:
    return NativeEngine(load_config(None, {"HOME": "/tmp"}, {
        "engine.name": "native", "engine.model": str(embedded_model), "engine.dtype": "float32",
        **{f"engine.args.{key}": str(value) for key, value in args.items()}}))


def requests_for(engine: NativeEngine, speculative: bool, max_tokens: int = 64, **sampling) -> list[GenerationRequest]:
    made = []
    for index, prompt in enumerate(PROMPTS):
        request = GenerationRequest(request_id=f"r{index}", messages=(ChatMessage("user", prompt),),
                                    sampling=SamplingParams(max_tokens=max_tokens, **sampling), speculative=speculative)
        request.prompt_token_ids = engine.encode(request)
        engine.prepare(request)
        made.append(request)
    return made


async def tokens_of(engine: NativeEngine, request: GenerationRequest) -> list[int]:
    return [t async for out in engine.stream_predict(request) for t in out.token_ids]


async def test_greedy_tokens_are_the_same_with_speculation_on_and_off(embedded_model):
    engine = engine_for(embedded_model, speculation="requested")
    await engine.load_model()
    try:
        off = [await tokens_of(engine, r) for r in requests_for(engine, False)]
        assert engine.speculation_stats() == (0, 0, 0)
        alone = [await tokens_of(engine, r) for r in requests_for(engine, True)]
        drafts, proposed, accepted = engine.speculation_stats()
        assert alone == off
        assert accepted > 0.5 * proposed > 0, "the paragraph is copied: most proposals are taken"
        together = await asyncio.gather(*(tokens_of(engine, r) for r in requests_for(engine, True)))
        assert list(together) == off
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


async def test_seeded_sampling_gives_the_same_tokens_with_speculation_on_and_off(embedded_model):
    """Every token emitted takes one draw from the request's generator, whichever step made it."""
    engine = engine_for(embedded_model, speculation="requested")
    await engine.load_model()
    try:
        runs = {}
        for on in (False, True, True):
            requests = requests_for(engine, on, temperature=0.7, top_p=0.95, seed=11)
            runs.setdefault(on, []).append(await asyncio.gather(*(tokens_of(engine, r) for r in requests)))
        assert runs[True][0] == runs[True][1] == runs[False][0]
        assert engine.speculation_stats()[2] > 0, "sampled proposals were accepted"
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


@pytest.mark.parametrize("ending", ["abort", "deadline"])
async def test_a_stream_ended_mid_speculation_gives_back_every_block(embedded_model, ending):
    engine = engine_for(embedded_model)
    await engine.load_model()
    try:
        request = requests_for(engine, True, max_tokens=400, ignore_eos=True)[3]
        stream = engine.stream_predict(request)
        async for output in stream:
            if len(output.token_ids) > 1:  # proposals were accepted in this step: the next one speculates too
                break
        else:
            pytest.fail("no step accepted a proposal")
        if ending == "deadline":  # as the servicer's timer ends a stream, then releases it
            stream.fail(RequestDeadlineExceeded("deadline passed while generating"))
        engine.abort(stream)
        for _ in range(500):
            if engine.num_unfinished() == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
        assert await tokens_of(engine, requests_for(engine, True, max_tokens=4)[1]), "the engine still serves"
    finally:
        await engine.unload_model()


@pytest.mark.parametrize(("args", "key"), [
    ({"speculation": "always"}, "engine.args.speculation"),
    ({"speculative_tokens": 17}, "engine.args.speculative_tokens"),
    ({"speculative_ngram_min": 3, "speculative_ngram_max": 2}, "engine.args.speculative_ngram_min"),
])
def test_speculation_settings_are_checked(embedded_model, args, key):
    with pytest.raises(ConfigError, match=key):
        engine_for(embedded_model, **args)


async def test_steps_launched_ahead_through_a_double_of_the_graphs_give_the_same_tokens(embedded_model, monkeypatch):
    """With a TEST DOUBLE of the CUDA graphs (tests/doubles/graphs.py: their steps run eagerly on the
    CPU), steps go ahead of their predecessors' tokens as on CUDA (worker/engines/native/ahead.py):
    decodes, and checks with a run for each outcome of the check before, of which the one that
    stands is kept: the whole draft accepted (the next proposals checked), or one rejected (the
    token chosen there). Greedy tokens are those of speculation off, alone and batched, and every
    block comes back, after an abort with a check in flight too."""
    from tests.doubles.graphs import EagerGraphs

    launched = []
    checks, decodes = ahead.checks, ahead.decodes
    monkeypatch.setattr(ahead, "checks", lambda engine, step: launched.append(checks(engine, step)) or launched[-1])
    monkeypatch.setattr(ahead, "decodes", lambda engine, step: launched.append(decodes(engine, step)) or launched[-1])
    runs = record_check_runs(monkeypatch)
    engine = engine_for(embedded_model, speculation="requested", overlap_output="true")
    await engine.load_model()
    engine.graphs = EagerGraphs(engine.model, engine.k_cache, engine.v_cache, max_batch=64)
    # What goes ahead and how long a draft is are set by measured times: here by nothing but the tokens.
    engine.speculator.schedules_next = lambda: True  # proposing pays: a step that may propose is scheduled
    engine.speculator.step_cost.fit = lambda: None  # rows are free: drafts go in whole
    try:
        off = [await tokens_of(engine, r) for r in requests_for(engine, False, max_tokens=48)]
        assert [await tokens_of(engine, r) for r in requests_for(engine, True, max_tokens=48)] == off
        together = await asyncio.gather(*(tokens_of(engine, r) for r in requests_for(engine, True, max_tokens=48)))
        assert list(together) == off
        kinds = {(step.verifying != [], step.launched_at) for step in launched if step is not None}
        assert kinds == {(False, 0.0), (True, 0.0)}, "decodes and checks both went ahead"
        assert {(True, True, True), (True, False, True), (False, True, True), (False, False, True)} <= set(runs), \
            "runs kept and dropped: after a whole draft accepted and after a rejection"
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
        before, aborted = len(launched), False
        stream = engine.stream_predict(requests_for(engine, True, max_tokens=400, ignore_eos=True)[3])
        async for _ in stream:
            if not aborted and any(step is not None and step.verifying for step in launched[before:]):
                engine.abort(stream)
                aborted = True
        assert aborted
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()


async def test_the_warm_up_checks_proposals_and_leaves_the_speculator_as_a_new_engine_s(tiny_llama):
    """warmup.py (run on CUDA before the worker is ready) runs requests that speculate, so the first
    use of the checks' paths is paid before service, then forgets what its steps taught: a fresh
    worker's first requests that asked to speculate had proposals priced by the warm-up's compiles
    (an H200, SmolLM2: 2 checks where the next requests made 5, and 33 ms against 22 without)."""
    from worker.engines.native.warmup import warm_up

    engine = NativeEngine(load_config(None, {"HOME": "/tmp"}, {
        "engine.name": "native", "engine.model": str(tiny_llama), "engine.dtype": "float32",
        "engine.args.speculation": "requested"}))
    await engine.load_model()
    learned = []
    forget = engine.speculator.forget
    engine.speculator.forget = lambda: (learned.append((engine.speculation_stats(), engine.speculator.step_cost.fit())),
                                        forget())
    try:
        await warm_up(engine)
        (drafts, proposed, _), fit = learned[0]
        assert drafts > 0 and proposed > drafts and fit is not None, "the warm-up checked proposals, in steps of varying rows"
        assert engine.speculation_stats() == (0, 0, 0) and engine.speculator.step_cost.fit() is None
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()

"""WorkerControl.CacheEvents: the engine's prefix cache as a snapshot and then its changes, named
by the same hash chain a router computes from a request's tokens."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from array import array

import grpc
import httpx
import pytest
import torch

from worker.engines.cache_events import CacheEvents
from worker.errors import CacheSubscriberLagging
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

BLOCK = 16


def chain(token_ids: list[int], block_size: int = BLOCK) -> list[bytes]:
    """The names of a prompt's full blocks, as the contract defines them (not the engine's code)."""
    hashes, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start:start + block_size]).tobytes()).digest()
        hashes.append(parent)
    return hashes


async def test_batches_say_what_changed_and_a_snapshot_joins_them():
    events = CacheEvents(BLOCK)
    events.publish([("stored", b"a", b"", [1]), ("stored", b"b", b"a", [2])])
    subscription = events.subscribe()
    snapshot = await anext(subscription)
    assert snapshot.snapshot and snapshot.sequence == 1 and [h for h, _, _ in snapshot.stored] == [b"a", b"b"]
    # One step: b evicted, c stored, d stored and evicted again, a evicted and stored again.
    events.publish([("removed", b"b"), ("stored", b"c", b"a", [3]), ("stored", b"d", b"c", [4]), ("removed", b"d"),
                    ("removed", b"a"), ("stored", b"a", b"", [1])])
    events.publish([("stored", b"x", b"", [9]), ("removed", b"x")])  # no net change: no batch
    events.publish([("removed", b"c")])
    first, second = await anext(subscription), await anext(subscription)
    assert (first.sequence, first.snapshot, first.stored, first.removed) == (2, False, [(b"c", b"a", [3])], [b"b"])
    assert (second.sequence, second.stored, second.removed) == (3, [], [b"c"])
    late_subscription = events.subscribe()
    late = await anext(late_subscription)
    assert late.sequence == 3 and [h for h, _, _ in late.stored] == [b"a"]
    for open_one in (subscription, late_subscription):
        await open_one.aclose()
    assert not events._subscribers  # a subscriber that leaves is forgotten


async def test_a_subscriber_that_falls_behind_is_ended():
    events = CacheEvents(BLOCK, max_pending=2)
    subscription = events.subscribe()
    await anext(subscription)
    for index in range(3):
        events.publish([("stored", bytes([index]), b"", [index])])
    assert [(await anext(subscription)).sequence for _ in range(2)] == [1, 2]
    with pytest.raises(CacheSubscriberLagging):
        await anext(subscription)
    assert (await anext(events.subscribe())).sequence == 3  # a new subscription starts from a snapshot


async def test_the_native_engine_publishes_its_cache_and_evictions(embedded_model):
    from tests.test_native_engine import engine_for, generate
    from worker.engines.native.model import load_model

    weights_gib = load_model(embedded_model, torch.float32, torch.device("cpu")).weight_bytes() / (1 << 30)
    # Room for about 19 blocks: the prompts below need more, so older blocks are evicted.
    engine = engine_for(embedded_model, **{"resources.memory_limit_gib": str(weights_gib + 0.0135)})
    await engine.load_model()
    subscription = engine.events.subscribe()
    try:
        assert (await anext(subscription)).stored == []
        prompts = [[(7 * p + i) % 5000 + 10 for i in range(50 + 10 * p)] for p in range(8)]
        await generate(engine, prompts[:1], together=False)
        stored = (await asyncio.wait_for(anext(subscription), 10)).stored
        # 50 prompt tokens and 63 generated: the first 7 blocks are full; the first 3 hold only the prompt.
        assert [h for h, _, _ in stored][:3] == chain(prompts[0])
        assert stored[1][1] == stored[0][0] and stored[0][1] == b"" and stored[0][2] == prompts[0][:BLOCK]
        await generate(engine, prompts[1:], together=False)
        removed: set[bytes] = set()
        while not removed:  # the cache holds about 19 blocks, the prompts need about 60
            removed |= set((await asyncio.wait_for(anext(subscription), 5)).removed)
        # The last step's batch reached the loop in the same wake-up as its tokens.
        snapshot = await anext(engine.events.subscribe())
        assert {h for h, _, _ in snapshot.stored} == set(engine.blocks._cached)
    finally:
        await subscription.aclose()
        await engine.unload_model()


async def test_the_synthetic_engine_s_cache_saves_prefill_and_evicts_tails_first():
    from worker.config_loader import load_config
    from worker.engines.synthetic import SyntheticEngine
    from worker.request import GenerationRequest, SamplingParams

    config = load_config(None, {"HOME": "/tmp"}, {
        "engine.name": "synthetic", "engine.args.block_size": "4", "engine.args.prefix_cache_blocks": "6",
        "engine.args.prefill_tokens_per_s": "100", "engine.args.prefill_lanes": "1"})
    engine = SyntheticEngine(config)
    await engine.load_model()
    subscription = engine.events.subscribe()
    loop = asyncio.get_running_loop()

    async def first_token_after(ids: list[int]) -> float:
        started = loop.time()
        request = GenerationRequest(request_id="r", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=1))
        async for _ in engine.stream_predict(request):
            pass
        return loop.time() - started

    try:
        assert (await anext(subscription)).stored == []
        prompt = list(range(100, 117))  # 17 tokens: 4 full blocks before the last token
        cold = await first_token_after(prompt)
        stored = (await anext(subscription)).stored
        assert {h: p for h, p, _ in stored} == dict(zip(chain(prompt, 4), [b"", *chain(prompt, 4)[:-1]]))
        assert engine.prefix_cache_stats() == (16, 0)
        warm = await first_token_after(prompt + [5, 6, 7, 8])  # 16 of 21 tokens cached
        assert engine.prefix_cache_stats() == (36, 16)
        assert cold >= 0.16 and warm < 0.1, (cold, warm)  # 17 and 5 uncached tokens at 100/s
        await anext(subscription)
        # Six blocks hold: a new 3-block prompt evicts the 5-block chain's last two.
        other = list(range(500, 513))
        await first_token_after(other)
        batch = await anext(subscription)
        assert set(batch.removed) == set(chain(prompt + [5, 6, 7, 8], 4)[3:])
        assert engine.prefix_cache_stats()[1] == 16
        # Prefills wait for each other (one lane): two at once take twice as long as one.
        started = loop.time()
        await asyncio.gather(first_token_after(list(range(900, 910))), first_token_after(list(range(950, 960))))
        assert loop.time() - started >= 0.2
    finally:
        await subscription.aclose()
        await engine.unload_model()


def test_cache_events_over_grpc_and_after_a_restart(worker_process, embedded_model):
    worker = worker_process("--engine", "native", "--model", str(embedded_model))
    worker.wait_ready()
    ids = list(range(100, 150))
    with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
        control = pb_grpc.WorkerControlStub(channel)
        assert control.GetInfo(pb.GetInfoRequest(), timeout=5).capabilities.cache_events
        stream = control.CacheEvents(pb.CacheEventsRequest(), timeout=60)
        first = next(stream)
        assert first.snapshot and first.block_size == BLOCK
        seen: set[bytes] = set()
        found = threading.Event()

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled below
                for batch in stream:
                    seen.update(block.hash for block in batch.stored)
                    if set(chain(ids)) <= seen:
                        found.set()

        threading.Thread(target=read, daemon=True).start()
        inference = pb_grpc.InferenceServiceStub(channel)
        request = pb.PredictRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=2))
        list(inference.StreamPredict(request, timeout=30))
        named = control.PrefixHashes(request, timeout=10)  # what a router looks up: the same names
        assert list(named.hashes) == chain(ids) and (named.prompt_tokens, named.block_size) == (50, BLOCK)
        assert found.wait(5)  # the reader thread gets the step's batch a moment after the answer
        again = next(control.CacheEvents(pb.CacheEventsRequest(), timeout=10))
        assert again.snapshot and again.sequence >= 1 and set(chain(ids)) <= {b.hash for b in again.stored}
        stream.cancel()
    socket_path = worker.socket_path
    worker.stop()
    restarted = worker_process("--engine", "native", "--model", str(embedded_model), socket_path=socket_path)
    restarted.wait_ready()
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        fresh = next(pb_grpc.WorkerControlStub(channel).CacheEvents(pb.CacheEventsRequest(), timeout=10))
        # A new cache (its warm-up's blocks only): a router replaces its view of this worker.
        assert fresh.snapshot and not set(chain(ids)) & {b.hash for b in fresh.stored}


def test_an_engine_without_cache_events_says_so(worker_process):
    worker = worker_process("--engine", "synthetic")
    worker.wait_ready()
    with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
        control = pb_grpc.WorkerControlStub(channel)
        assert not control.GetInfo(pb.GetInfoRequest(), timeout=5).capabilities.cache_events
        with pytest.raises(grpc.RpcError) as error:
            next(control.CacheEvents(pb.CacheEventsRequest(), timeout=5))
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED and "synthetic" in error.value.details()


def test_the_sidecar_follows_each_worker_s_cache_and_starts_over_after_a_restart(worker_process, sidecar,
                                                                                 embedded_model):
    from tests.test_observability import wait_for
    from tests.test_sidecar_faults import metric

    native = worker_process("--engine", "native", "--model", str(embedded_model))
    synthetic = worker_process("--engine", "synthetic")
    native.wait_ready()
    synthetic.wait_ready()
    front = sidecar([native.socket_path, synthetic.socket_path])
    front.wait_ready()

    def known(worker: str) -> tuple[float, float]:
        return (metric(front, "cyllm_sidecar_cache_events_live", worker=worker),
                metric(front, "cyllm_sidecar_prefix_index_blocks", worker=worker))

    assert wait_for(lambda: known("w0")[0] == 1, timeout=10), front.log()[-2000:]
    warm = known("w0")[1]  # the warm-up's blocks
    assert warm > 0 and known("w1") == (0, 0)  # the synthetic engine publishes nothing: routed by load
    with grpc.insecure_channel(f"unix:{native.socket_path}") as channel:
        list(pb_grpc.InferenceServiceStub(channel).StreamPredict(pb.PredictRequest(
            token_ids=pb.TokenIds(ids=list(range(100, 150))), sampling=pb.SamplingParams(max_tokens=2)), timeout=30))
    assert wait_for(lambda: known("w0")[1] >= warm + 3, timeout=10)
    socket_path = native.socket_path
    native.stop()
    # Its stream is gone: what it held is unknown, so nothing is assumed.
    assert wait_for(lambda: known("w0") == (0, 0), timeout=10)
    restarted = worker_process("--engine", "native", "--model", str(embedded_model), socket_path=socket_path)
    restarted.wait_ready()
    assert wait_for(lambda: known("w0") == (1, warm), timeout=20), known("w0")  # a new cache, a new snapshot
    assert metric(front, "cyllm_sidecar_cache_event_resyncs_total", worker="w0") >= 1


def test_cache_aware_routing_sends_a_shared_prefix_where_it_is_cached(worker_process, sidecar, embedded_model):
    """Two native workers: requests that share a long system prompt go where its blocks are, and
    answer what either worker answers alone; with that worker gone, the other serves by load."""
    from tests.test_observability import logged, wait_for
    from tests.test_sidecar_faults import metric

    workers = [worker_process("--engine", "native", "--model", str(embedded_model)) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    front = sidecar([w.socket_path for w in workers], "--routing", "cache-aware")
    front.wait_ready()
    assert wait_for(lambda: metric(front, "cyllm_sidecar_cache_events_live") == 2, timeout=10)
    system = "You are the archivist of a very old library. Answer briefly and cite the shelf. " * 6

    def ask(question: str, request_id: str) -> str:
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{front.http}/v1/chat/completions", json=body, headers={"x-request-id": request_id}, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    ask("Where is Dune?", "first")
    assert wait_for(lambda: any(logged(w, "first") for w in workers), timeout=5)
    home = next(w for w in workers if logged(w, "first"))
    # The first answer's blocks reach the index before the next request is routed.
    assert wait_for(lambda: metric(front, "cyllm_sidecar_prefix_index_blocks") >= 10, timeout=10)
    answers = {f"q{i}": ask(q, f"q{i}") for i, q in enumerate(("Who wrote Emma?", "Is Ulysses long?", "Where is Dune?"))}
    assert all(wait_for(lambda: logged(home, request_id), timeout=5) for request_id in answers), "not sent to the cache"
    assert metric(front, "cyllm_sidecar_routing_decisions_total", reason="cache_hit") >= 3
    assert metric(front, "cyllm_sidecar_predicted_prefix_hit_tokens_total") >= 3 * 16 * 6
    # The same answer from either worker alone (greedy), so where it ran does not show.
    for worker in workers:
        with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
            request = pb.PredictRequest(sampling=pb.SamplingParams(max_tokens=8, temperature=0))
            request.chat.messages.add(role="system", content=system)
            request.chat.messages.add(role="user", content="Where is Dune?")
            direct = "".join(r.text for r in pb_grpc.InferenceServiceStub(channel).StreamPredict(request, timeout=60))
        assert direct == answers["q2"]
    home.stop()
    assert wait_for(lambda: metric(front, "cyllm_sidecar_cache_events_live") == 1, timeout=10)
    assert ask("Who wrote Emma?", "after") == answers["q0"]  # the other worker, by load


def test_an_evicted_prefix_stops_drawing_requests(worker_process, sidecar):
    """Two synthetic workers with small prefix caches: a prompt goes where it is cached; once that
    worker evicts it, the next copy is routed as a miss (to its home), and the one after follows it."""
    from tests.test_observability import logged, wait_for
    from tests.test_sidecar_faults import metric

    cache = ("--engine", "synthetic", "--set", "engine.args.block_size=4", "--set", "engine.args.prefix_cache_blocks=10")
    workers = [worker_process(*cache) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    front = sidecar([w.socket_path for w in workers], "--routing", "cache-aware")
    front.wait_ready()
    assert wait_for(lambda: metric(front, "cyllm_sidecar_cache_events_live") == 2, timeout=10)
    prompt = " ".join(f"p{i}" for i in range(17))  # 4 cacheable blocks of 4 words

    def direct(worker, text: str) -> None:
        with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
            list(pb_grpc.InferenceServiceStub(channel).StreamPredict(
                pb.PredictRequest(prompt=text, sampling=pb.SamplingParams(max_tokens=1)), timeout=10))

    def routed(request_id: str) -> tuple[int, str]:
        reply = httpx.post(f"{front.http}/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                           headers={"x-request-id": request_id}, timeout=10)
        assert reply.status_code == 200, reply.text
        assert wait_for(lambda: any(logged(w, request_id) for w in workers), timeout=5)
        return next(i for i, w in enumerate(workers) if logged(w, request_id)), reply.json()["choices"][0]["text"]

    def decisions(reason: str) -> float:
        return metric(front, "cyllm_sidecar_routing_decisions_total", reason=reason)

    direct(workers[0], prompt)
    assert wait_for(lambda: metric(front, "cyllm_sidecar_prefix_index_blocks", worker="w0") >= 4, timeout=5)
    assert metric(front, "cyllm_sidecar_prefix_index_blocks", worker="w0") < 10
    assert routed("hit")[0] == 0 and decisions("cache_hit") == 1
    direct(workers[0], " ".join(f"q{i}" for i in range(41)))  # 10 blocks: the whole cache, the prompt evicted
    assert wait_for(lambda: metric(front, "cyllm_sidecar_prefix_index_blocks", worker="w0") == 10, timeout=5)
    home, text = routed("after")
    assert (decisions("cache_hit"), decisions("cache_miss")) == (1, 1)
    assert routed("again") == (home, text) and decisions("cache_hit") == 2  # where it is cached now


def test_a_worker_whose_event_stream_dies_keeps_serving_by_load(worker_process, sidecar):
    """A worker whose cache-event messages outgrow the sidecar's limit loses its stream for good:
    the sidecar forgets its blocks, keeps asking now and then, and sends it its share by load."""
    from tests.test_observability import logged, wait_for
    from tests.test_sidecar_faults import metric

    cache = ("--engine", "synthetic", "--set", "engine.args.block_size=4", "--set", "engine.args.prefix_cache_blocks=100",
             "--set", "engine.args.tokens_per_s=40")
    workers = [worker_process(*cache) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    front = sidecar([w.socket_path for w in workers], "--routing", "cache-aware", "--cache-event-max-bytes", "2048")
    front.wait_ready()
    assert wait_for(lambda: metric(front, "cyllm_sidecar_cache_events_live") == 2, timeout=10)
    long_prompt = " ".join(f"w{i}" for i in range(200))  # 50 blocks: one batch of about 5 KB
    with grpc.insecure_channel(f"unix:{workers[0].socket_path}") as channel:
        list(pb_grpc.InferenceServiceStub(channel).StreamPredict(
            pb.PredictRequest(prompt=long_prompt, sampling=pb.SamplingParams(max_tokens=1)), timeout=10))
    # The batch, then every snapshot after it, is over the limit: w0's view is gone and stays gone.
    assert wait_for(lambda: metric(front, "cyllm_sidecar_cache_event_resyncs_total", worker="w0", reason="too_large") >= 2,
                    timeout=10), front.log()[-2000:]
    assert metric(front, "cyllm_sidecar_cache_events_live", worker="w0") == 0
    assert metric(front, "cyllm_sidecar_prefix_index_blocks", worker="w0") == 0
    assert metric(front, "cyllm_sidecar_cache_events_live", worker="w1") == 1

    def ask(index: int) -> None:
        prompt = " ".join(f"q{index}x{i}" for i in range(12))  # 2 blocks, cached nowhere
        reply = httpx.post(f"{front.http}/v1/completions", json={"prompt": prompt, "max_tokens": 20},
                           headers={"x-request-id": f"r{index}"}, timeout=30)
        assert reply.status_code == 200, reply.text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    served = [sum(wait_for(lambda: logged(w, f"r{i}"), timeout=0.5) for i in range(8)) for w in workers]
    assert sum(served) == 8 and min(served) >= 2, served  # both workers took their share

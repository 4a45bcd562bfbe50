"""engine.own_process: the engine in a process of its own (engines/process.py and hosted.py). The
worker's answers are those of the engine in process; what a request holds comes back however it
ends; the engine's process ends with the worker, and the worker with it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.conftest import child_pids, running_worker, synthetic_request
from worker.config import ConfigError
from worker.config_loader import load_config
from worker.engines.factory import runs_in_own_process, create_engine
from worker.request import GenerationRequest, RequestOutput, SamplingParams, TokenLogprob
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb

SYNTHETIC = ("--engine", "synthetic", "--set", "engine.own_process=true")
SLOW = {"engine.args.step_ms": "10"}  # a token for every request each 10 ms


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][0] != "Z"


def test_auto_puts_the_native_engine_on_cuda_in_a_process_of_its_own():
    def own(**settings) -> bool:
        config = load_config(None, {"HOME": "/tmp"}, {"server.socket": "/tmp/x.sock", **settings})
        return runs_in_own_process(config)

    assert own(**{"engine.name": "native", "engine.device": "cuda"})
    assert own(**{"engine.name": "native", "engine.device": "cuda:1"})
    assert not own(**{"engine.name": "native", "engine.device": "cpu"})
    assert not own(**{"engine.name": "transformers", "engine.device": "cuda"})
    assert not own(**{"engine.name": "vllm", "engine.device": "cuda"})
    assert own(**{"engine.name": "synthetic", "engine.own_process": "true"})
    assert not own(**{"engine.name": "native", "engine.device": "cuda", "engine.own_process": "false"})
    with pytest.raises(ConfigError, match="engine.own_process"):
        own(**{"engine.own_process": "sometimes"})


@pytest.mark.model
async def test_a_slot_comes_back_at_the_launch_of_the_last_step_across_processes(embedded_model):
    """RequestStream.ending crosses too: the worker's stream releases (on_finish) before its last
    output, as with the engine in process (test_native_engine)."""
    config = load_config(None, {"HOME": "/tmp"}, {"server.socket": "/tmp/x.sock", "engine.name": "native",
                                                   "engine.model": str(embedded_model), "engine.own_process": "true"})
    engine = create_engine(config)
    await engine.load_model()
    try:
        released_early = []
        stream = engine.stream_predict(GenerationRequest(
            request_id="r", prompt_token_ids=[1, 2, 3],
            sampling=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
        stream.on_finish = lambda: released_early.append(not stream.finished)
        tokens = [token for output in [o async for o in stream] for token in output.token_ids]
        assert len(tokens) == 5 and released_early == [True]
    finally:
        await engine.unload_model()


@pytest.mark.model
async def test_the_wait_for_a_refilled_row_goes_through_the_worker(embedded_model):
    """On CPU a step after one that ended a request waits (briefly) for the request admitted into
    its slot (ThreadedEngine.after_admissions), so that it runs it. An end by a stop id is not known
    when its step is launched, so no early release (`ending`) covers it: in its own process, the
    engine's marker must come back through the worker after the admitted request was sent."""
    settings = {"engine.name": "native", "engine.model": str(embedded_model), "engine.own_process": "true",
                "resources.max_concurrency": 2}
    greedy = {"temperature": 0.0}
    async with running_worker(**settings) as (worker, client):
        probe = await client.collect(synthetic_request(max_tokens=3, return_token_ids=True, sampling=greedy))
        stop_id = [i for r in probe for i in r.token_ids][2]
        sent, send = [], worker.engine._send
        worker.engine._send = lambda message: (sent.append(message[0]), send(message))
        long = asyncio.ensure_future(client.collect(synthetic_request(max_tokens=24, sampling=greedy)))
        first = asyncio.ensure_future(client.collect(synthetic_request(
            max_tokens=24, sampling={**greedy, "stop_token_ids": [stop_id]})))
        while sent.count("add") < 2:
            await asyncio.sleep(0.01)
        replies = await asyncio.gather(long, first, client.collect(synthetic_request(max_tokens=4)))
        assert replies[1][-1].finish_reason == pb.FINISH_REASON_STOP
        assert [r[-1].usage.completion_tokens for r in replies[::2]] == [24, 4]
        adds = [i for i, kind in enumerate(sent) if kind == "add"]
        assert "sync" in sent and adds[2] < sent.index("sync"), sent


@pytest.mark.model
async def test_the_native_engine_answers_as_it_does_in_process(embedded_model):
    """Greedy text and ids, logprobs with their bytes, a JSON schema (its compiled grammar crosses
    serialized), a stop string and a cancelled stream, on the embedded model, against the engine in
    process. Text without stop strings is made in the worker's process (BaseEngine.leaves_text)."""
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    requests = [
        pb.PredictRequest(prompt="The capital of France is", return_token_ids=True, logprobs=2,
                          sampling=pb.SamplingParams(max_tokens=12, temperature=0)),
        pb.PredictRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Name a city as JSON.")]),
                          structured_output=pb.StructuredOutput(json_schema=schema),
                          sampling=pb.SamplingParams(max_tokens=40, temperature=0)),
        pb.PredictRequest(prompt="Paris is a city. London is", sampling=pb.SamplingParams(max_tokens=30, temperature=0,
                                                                                          stop=["."])),
    ]
    answers = {}
    for own in (False, True):
        settings = {"engine.name": "native", "engine.model": str(embedded_model), "engine.own_process": str(own).lower()}
        async with running_worker(**settings) as (worker, client):
            answers[own] = []
            for request in requests:
                replies = await client.collect(request)
                answers[own].append(("".join(r.text for r in replies), [i for r in replies for i in r.token_ids],
                                     [(e.token_id, e.bytes, round(e.logprob, 3)) for r in replies for e in r.logprobs],
                                     replies[-1].finish_reason, replies[-1].usage.completion_tokens))
            call = client.inference.StreamPredict(pb.PredictRequest(
                prompt="Count to a thousand:", sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True)))
            await anext(aiter(call))
            call.cancel()
            load = await client.wait_idle()
            assert (load.running, load.budget_tokens_used) == (0, 0)
            for _ in range(100):  # the engine's count crosses with its next message
                if worker.engine.num_unfinished() == 0:
                    break
                await asyncio.sleep(0.02)
            assert worker.engine.num_unfinished() == 0
            if own:
                assert worker.engine.front.tokenizer is not None and worker.engine._eos_ids  # it makes the text
                metrics = (await client.control.Metrics(pb.MetricsRequest())).text
                assert 'cyllm_device_memory_used_bytes{device="cpu"}' in metrics or worker.engine.get_memory_usage() == {}
    assert answers[True] == answers[False]
    assert answers[True][0][2] and json.loads(answers[True][1][0])["city"]
    assert answers[True][2][3] == pb.FINISH_REASON_STOP and "." not in answers[True][2][0]


def test_an_output_crosses_the_socket_as_its_fields():
    """The engine's process sends each output as RequestOutput.fields() (plain values pickle ~7x
    faster than the dataclass); the worker's side makes the same output of them."""
    output = RequestOutput(text=" a", token_ids=[5, 6], finish_reason="stop",
                           logprobs=[TokenLogprob(5, -0.5, [(5, -0.5), (7, -1.5)]), TokenLogprob(6, -0.1)],
                           prompt_logprobs=[TokenLogprob(3, None), TokenLogprob(4, -2.0)])
    assert len(output.fields()) == len(dataclasses.fields(RequestOutput))
    assert RequestOutput(*pickle.loads(pickle.dumps(output.fields()))) == output


FROZEN = """
import asyncio, gc, socket, threading
from worker.config_loader import load_config
from worker.engines import hosted


async def worker_side(sock):
    channel = await hosted.Channel.open(sock)
    channel.send(load_config(None, {"HOME": "/tmp"}, {"engine.name": "synthetic", "server.socket": "/tmp/x.sock"}))
    for kind in ("loaded", "warmed"):
        while (await channel.receive())[0] != kind:
            pass
        print(kind, gc.get_freeze_count())
        channel.send(("warmup",) if kind == "loaded" else ("stop",))
    while (await channel.receive())[0] != "stopped":
        pass


ours, theirs = socket.socketpair()
engine = threading.Thread(target=lambda: asyncio.run(hosted._serve(theirs.detach())))
engine.start()
asyncio.run(worker_side(ours))
engine.join()
"""


def test_the_engine_s_process_freezes_what_it_loaded():
    """The engine's process runs the steps, so a full collection of what it loaded would stall every
    stream (164 ms on an H200 host): frozen once loaded and once warmed up, as the worker's own
    process is. Both ends of the socket pair in one fresh interpreter, whose freeze count is read."""
    done = subprocess.run([sys.executable, "-c", FROZEN], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    counts = dict(line.split() for line in done.stdout.splitlines())
    assert int(counts["loaded"]) > 10_000 and int(counts["warmed"]) > int(counts["loaded"])  # its tasks since


async def test_cache_events_and_early_release_cross_from_the_engine_s_process():
    settings = {**SLOW, "engine.own_process": "true", "engine.args.prefix_cache_blocks": "64"}
    async with running_worker(**settings) as (worker, client):
        subscription = client.control.CacheEvents(pb.CacheEventsRequest())
        snapshot = await anext(aiter(subscription))
        assert snapshot.snapshot
        prompt = " ".join(f"word{i}" for i in range(40))
        await client.collect(synthetic_request(max_tokens=4, prompt=prompt))
        batch = await asyncio.wait_for(anext(aiter(subscription)), 10)
        assert batch.stored and batch.sequence == snapshot.sequence + 1
        subscription.cancel()
        # 20 requests through 8 slots: each slot comes back and is taken again while streams run.
        replies = await asyncio.gather(*[client.collect(synthetic_request(max_tokens=10)) for _ in range(20)])
        assert all(r[-1].usage.completion_tokens == 10 for r in replies)
        assert (await client.wait_idle()).budget_tokens_used == 0


async def test_a_deadline_and_a_bad_request_give_back_what_they_held():
    async with running_worker(**SLOW, **{"engine.own_process": "true"}) as (worker, client):
        status = await client.status_of(synthetic_request(max_tokens=1000), timeout=0.3)
        assert status == grpc.StatusCode.DEADLINE_EXCEEDED
        bad = synthetic_request(max_tokens=4)
        bad.sampling.stop_token_ids.append(10**9)
        assert await client.status_of(bad) == grpc.StatusCode.INVALID_ARGUMENT
        load = await client.wait_idle()
        assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)
        assert await client.status_of(synthetic_request()) == grpc.StatusCode.OK


def test_a_killed_engine_process_fails_every_stream_and_the_worker_exits(worker_process):
    from tests.test_lifecycle import stream_in_thread

    worker = worker_process(*SYNTHETIC, "--set", "engine.args.step_ms=10")
    worker.wait_ready()
    engine_pid, = child_pids(worker.proc.pid)
    streams = [{} for _ in range(3)]
    threads = [stream_in_thread(worker.socket_path, 5000, results) for results in streams]
    assert all(results["first"].wait(20) for results in streams)
    os.kill(engine_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(20)
    assert [results["code"] for results in streams] == [grpc.StatusCode.UNAVAILABLE] * 3
    assert all(results["responses"] for results in streams)
    assert worker.wait(20) == 1
    assert "engine process ended" in worker.log()


def test_sigterm_drains_then_the_engine_s_process_ends_with_the_worker(worker_process):
    from tests.test_lifecycle import stream_in_thread

    worker = worker_process(*SYNTHETIC, "--set", "engine.args.step_ms=10")
    worker.wait_ready()
    engine_pid, = child_pids(worker.proc.pid)
    results: dict = {}
    thread = stream_in_thread(worker.socket_path, 100, results)
    assert results["first"].wait(20)
    # As a terminal's Ctrl-C or a process group's SIGTERM reaches it: the worker decides.
    os.kill(engine_pid, signal.SIGINT)
    os.kill(engine_pid, signal.SIGTERM)
    worker.signal(signal.SIGTERM)
    thread.join(20)
    assert results["code"] == grpc.StatusCode.OK and results["responses"][-1].usage.completion_tokens == 100
    assert worker.wait(30) == 0
    assert not alive(engine_pid)


def test_a_load_that_fails_in_the_engine_s_process_is_reported_as_itself(worker_process):
    worker = worker_process("--engine", "native", "--model", "/nonexistent/model", "--set", "engine.own_process=true")
    assert worker.wait(120) == 3
    assert "model failed to load" in worker.log() and "/nonexistent/model" in worker.log()


def test_engines_with_processes_of_their_own_refuse_the_setting():
    for name in ("vllm", "trtllm"):
        with pytest.raises(ConfigError, match="engine.own_process"):
            load_config(None, {"HOME": "/tmp"}, {"engine.name": name, "engine.own_process": "true",
                                                   "server.socket": "/tmp/x.sock"})

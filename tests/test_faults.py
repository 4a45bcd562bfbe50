"""Fault injection and bad input: every accepted request ends in one finished stream or one definite
status, and every slot and budget taken is given back (created == released)."""

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
import time

import grpc
import pytest

from tests.conftest import REPO, running_worker, short_tmpdir, synthetic_request
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb

LOCKSTEP = {"engine.args": "{step_ms: 5}", "resources.max_concurrency": "128"}


async def unfinished(client) -> float:
    text = (await client.control.Metrics(pb.MetricsRequest())).text
    return float(re.search(r"^cyllm_engine_unfinished_requests (\S+)$", text, re.M).group(1))


async def tokens_then_cancel(client, request: pb.PredictRequest, after: int) -> int:
    """Reads `request`'s stream until `after` tokens arrived, then cancels it; returns the tokens seen."""
    seen = 0
    call = client.inference.StreamPredict(request)
    async for reply in call:
        seen += len(reply.token_ids)
        if seen >= after:
            call.cancel()
            break
    return seen


async def test_ten_of_a_hundred_streams_cancelled_mid_stream():
    async with running_worker(**LOCKSTEP) as (worker, client):
        async def full(i: int) -> int:
            replies = await client.collect(synthetic_request(max_tokens=40, request_id=f"s{i}", return_token_ids=True))
            return sum(len(r.token_ids) for r in replies)

        # The cancelled streams ask for far more than they read: a loaded client may get several
        # steps' tokens in one reply, and must still be mid-stream when it cancels.
        cancelled = [tokens_then_cancel(client, synthetic_request(max_tokens=400, request_id=f"c{i}", return_token_ids=True), 10)
                     for i in range(10)]
        results = await asyncio.gather(*(full(i) for i in range(90)), *cancelled)
        assert results[:90] == [40] * 90
        assert all(10 <= n < 400 for n in results[90:]), results[90:]
        load = await client.wait_idle()
        assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)
        assert await unfinished(client) == 0
        # The ids of cancelled requests are free again.
        assert await client.status_of(synthetic_request(max_tokens=2, request_id="c0")) == grpc.StatusCode.OK


async def test_all_hundred_cancelled_after_twenty_tokens():
    async with running_worker(**LOCKSTEP) as (worker, client):
        counts = await asyncio.gather(*(
            tokens_then_cancel(client, synthetic_request(max_tokens=500, return_token_ids=True), 20) for _ in range(100)))
        assert all(n >= 20 for n in counts)
        load = await client.wait_idle()
        assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)
        assert await unfinished(client) == 0


async def test_a_client_that_leaves_while_queued_costs_no_engine_work():
    async with running_worker(**{"resources.max_concurrency": "1", "engine.args": "{step_ms: 10}"}) as (worker, client):
        engine_requests = []
        original = worker.engine.stream_predict
        worker.engine.stream_predict = lambda request: (engine_requests.append(request.request_id), original(request))[1]
        admitting = asyncio.Event()
        admit = worker.scheduler.admit

        async def admit_and_tell(*args, **kwargs):
            admitting.set()  # the caller is queued by the time this coroutine first waits
            return await admit(*args, **kwargs)

        holder = client.inference.StreamPredict(synthetic_request(max_tokens=50, request_id="holder"))
        await holder.read()  # running: the one slot is taken
        worker.scheduler.admit = admit_and_tell
        queued = client.inference.StreamPredict(synthetic_request(max_tokens=5, request_id="leaver"))
        await admitting.wait()
        queued.cancel()
        while await holder.read() is not grpc.aio.EOF:
            pass
        await client.wait_idle()
        assert engine_requests == ["holder"]
        assert worker.scheduler.rejections["cancelled"] == 1
        assert "cyllm_rejections_total{reason=\"cancelled\"} 1.0" in (await client.control.Metrics(pb.MetricsRequest())).text


async def test_a_five_mib_message_and_a_huge_header_are_refused_by_the_library():
    async with running_worker() as (worker, client):
        huge = synthetic_request(prompt="x" * (5 * 1024 * 1024))
        assert await client.status_of(huge) == grpc.StatusCode.RESOURCE_EXHAUSTED
        call = client.inference.StreamPredict(synthetic_request(), metadata=(("x-pad", "y" * (1 << 20)),))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in call:
                pass
        assert error.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                                      grpc.StatusCode.UNAVAILABLE)
        assert await client.status_of(synthetic_request()) == grpc.StatusCode.OK
        assert (await client.wait_idle()).running == 0


async def test_a_client_pinging_every_six_seconds_keeps_a_silent_stream():
    """The worker's ping policy (server.keepalive_min_ping_interval_s, 5 s) on its own, with no
    other call on the connection to reset grpc's strikes: grpc's default (5 minutes between pings
    while nothing is sent, 2 strikes) closed such a stream with UNAVAILABLE "Too many pings"."""
    from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

    # A client that keeps pinging a call on which nothing is sent, every 6 s.
    options = [("grpc.keepalive_time_ms", 6000), ("grpc.keepalive_timeout_ms", 5000),
               ("grpc.http2.max_pings_without_data", 0), ("grpc.http2.min_time_between_pings_ms", 6000)]
    async with (running_worker(**{"engine.args.prefill_tokens_per_s": "1"}) as (worker, _),
                grpc.aio.insecure_channel(f"unix:{worker.config.server.socket}", options=options) as channel):
        call = pb_grpc.InferenceServiceStub(channel).StreamPredict(synthetic_request(prompt="word " * 40))
        messages = [message async for message in call]
    assert messages[-1].usage.completion_tokens == 8
    assert messages[0].timing.time_to_first_token_ms > 35_000


def test_the_worker_exits_when_its_parent_dies():
    """A parent (a shell standing in for the sidecar or the container's init) starts the worker
    with exit_with_parent and is killed with SIGKILL: the worker notices and exits."""
    socket_dir = short_tmpdir()
    script = (f"{sys.executable} -m worker serve --socket {socket_dir}/w.sock --engine synthetic "
              f"--set server.exit_with_parent=true & echo $! ; wait")
    parent = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              start_new_session=True)
    worker_pid = int(parent.stdout.readline())
    exited = os.pidfd_open(worker_pid)  # readable once the worker (not our child) exits
    try:
        with grpc.insecure_channel(f"unix:{socket_dir}/w.sock") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        parent.kill()
        parent.wait()
        if not select.select([exited], [], [], 10)[0]:
            os.kill(worker_pid, signal.SIGKILL)
            pytest.fail("the worker outlived its parent by 10 s")
    finally:
        os.close(exited)


def test_the_worker_has_no_tcp_listener_and_keeps_prompts_out_of_info_logs(worker_process):
    worker = worker_process("--engine", "synthetic")
    worker.wait_ready()
    secret = "quokka-marmalade"  # letters, not digits: a digit marker can turn up inside a log timestamp
    with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
        from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

        list(pb_grpc.InferenceServiceStub(channel).StreamPredict(synthetic_request(prompt=f"my secret prompt {secret}")))
    links = []
    for fd in os.listdir(f"/proc/{worker.proc.pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{worker.proc.pid}/fd/{fd}"))
        except FileNotFoundError:  # closed meanwhile
            pass
    inodes = {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        listening = [row for row in rows if row[3] == "0A" and row[9] in inodes]  # 0A: LISTEN
        assert listening == [], f"worker listens on TCP: {listening}"
    assert secret not in worker.log()


# --- property-based fuzzing: only documented statuses, never INTERNAL, never a crash ---

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = st.text(max_size=40)


@st.composite
def predict_requests(draw) -> pb.PredictRequest:
    sampling = pb.SamplingParams()
    for name, strategy in (("max_tokens", st.integers(0, 2**32 - 1)), ("temperature", floats), ("top_p", floats),
                           ("top_k", st.integers(-2**31, 2**31 - 1)), ("min_p", floats),
                           ("repetition_penalty", floats), ("presence_penalty", floats),
                           ("frequency_penalty", floats), ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(sampling, name, draw(strategy))
    sampling.stop.extend(draw(st.lists(texts, max_size=3)))
    sampling.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
    sampling.ignore_eos = draw(st.booleans())
    request = pb.PredictRequest(sampling=sampling, request_id=draw(st.one_of(st.just(""), texts)),
                                model=draw(st.sampled_from(["", "synthetic", "other"])),
                                priority=draw(st.integers(-2**31, 2**31 - 1)),
                                adapter=draw(st.sampled_from(["", "none-such"])),
                                return_token_ids=draw(st.booleans()))
    request.metadata.update(draw(st.dictionaries(texts, texts, max_size=3)))
    kind = draw(st.sampled_from(["prompt", "chat", "token_ids", "none"]))
    if kind == "prompt":
        request.prompt = draw(st.text(max_size=200))
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "tool", "x"]), texts),
                                           max_size=4)):
            request.chat.messages.add(role=role, content=content)
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)))
    return request


def test_fuzzed_predict_requests_get_documented_statuses(worker_process):
    worker = worker_process("--engine", "synthetic", "--set", "resources.max_queue=4")
    worker.wait_ready()
    from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        @FUZZ
        @given(predict_requests())
        def check(request):
            if request.sampling.HasField("max_tokens") and request.sampling.max_tokens > 64:
                request.sampling.max_tokens = 64  # valid sizes answer quickly; the invalid ones stay
            try:
                list(stub.StreamPredict(request, timeout=10))
                code = grpc.StatusCode.OK
            except grpc.RpcError as error:
                code = error.code()
            assert code in DOCUMENTED, (code, request)

        check()
        control = pb_grpc.WorkerControlStub(channel)
        load = control.GetLoad(pb.GetLoadRequest())
        assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)
    assert worker.proc.poll() is None and "Traceback" not in worker.log()


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=8)


@st.composite
def openai_bodies(draw) -> tuple[str, object]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    if draw(st.integers(0, 4)) == 0:
        return path, draw(json_values)  # anything at all
    body = {"model": draw(st.sampled_from(["synthetic", "", "nope", 7]))}
    optional = {"prompt": st.one_of(texts, st.lists(texts, max_size=2), st.integers()),
                "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot", 3]),
                                                            "content": st.one_of(texts, st.none(), st.integers())}),
                                     max_size=3),
                "max_tokens": st.one_of(st.integers(-5, 40), st.just(10**12)), "temperature": st.floats(-5, 5),
                "top_p": st.floats(-1, 2), "stream": st.booleans(), "stop": st.one_of(texts, st.lists(texts, max_size=5)),
                "n": st.integers(-1, 3), "seed": st.integers(-5, 2**70), "logprobs": st.booleans(),
                "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
    for key, strategy in optional.items():
        if draw(st.booleans()):
            body[key] = draw(strategy)
    return path, body


def test_fuzzed_openai_bodies_get_openai_errors_never_500(worker_process, sidecar):
    import httpx

    worker = worker_process("--engine", "synthetic", "--set", "engine.served_name=synthetic")
    worker.wait_ready()
    front = sidecar([worker.socket_path])
    front.wait_ready()
    with httpx.Client(base_url=front.http, timeout=20) as http:
        @FUZZ
        @given(openai_bodies())
        def check(case):
            path, body = case
            reply = http.post(path, json=body)
            assert reply.status_code in (200, 400, 404, 413, 429), (reply.status_code, reply.text, body)
            if reply.status_code != 200:
                error = reply.json()["error"]
                assert error["message"] and error["type"], reply.text

        check()
    assert front.proc.poll() is None and worker.proc.poll() is None


def test_a_model_that_fails_to_load(worker_process, tmp_path):
    """Exits 3 with a clear log line by default; configured to stay, it is alive and never ready,
    and requests get UNAVAILABLE naming the load error."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    worker = worker_process("--engine", "native", "--model", str(broken))
    assert worker.wait(60) == 3
    assert "model failed to load" in worker.log() and "native engine runs" in worker.log()

    staying = worker_process("--engine", "native", "--model", str(broken), "--set", "server.exit_on_load_failure=false")
    with grpc.insecure_channel(f"unix:{staying.socket_path}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 60
        # A live worker whose load failed shows it only in its log and its answers: watch the log.
        while "model failed to load" not in staying.log():
            assert time.monotonic() < deadline and staying.proc.poll() is None, staying.log()
            time.sleep(0.1)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        service = "cyllm.inference.v1.InferenceService"
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status != health_pb2.HealthCheckResponse.SERVING
        from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

        with pytest.raises(grpc.RpcError) as error:
            list(pb_grpc.InferenceServiceStub(channel).StreamPredict(synthetic_request(), timeout=5))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "failed to load" in error.value.details()
    assert staying.proc.poll() is None


def test_the_sidecar_dies_mid_stream(worker_process, sidecar):
    """SIGKILL of the sidecar during a stream: the client gets UNAVAILABLE, the worker frees the
    slot, the request ran once (no retry after its first token), and a new sidecar serves again."""
    from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

    worker = worker_process("--engine", "synthetic", "--set", "engine.args.step_ms=20")
    worker.wait_ready()
    front = sidecar([worker.socket_path])
    front.wait_ready()
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as channel:
        stream = pb_grpc.InferenceServiceStub(channel).StreamPredict(synthetic_request(max_tokens=1000))
        next(stream)
        front.proc.kill()
        with pytest.raises(grpc.RpcError) as error:
            for _ in stream:
                pass
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
        control = pb_grpc.WorkerControlStub(channel)
        deadline = time.monotonic() + 5
        # The worker learns of the lost connection on its own; nothing tells this process when.
        while control.GetLoad(pb.GetLoadRequest()).running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert control.GetLoad(pb.GetLoadRequest()).running == 0
        text = control.Metrics(pb.MetricsRequest()).text
        ended = dict(re.findall(r'^cyllm_requests_total\{status="(\w+)"\} (\S+)$', text, re.M))
        assert ended == {"CANCELLED": "1.0"}  # this request, once
    again = sidecar([worker.socket_path])
    again.wait_ready()
    with grpc.insecure_channel(f"127.0.0.1:{again.grpc_port}") as channel:
        assert list(pb_grpc.InferenceServiceStub(channel).StreamPredict(synthetic_request(max_tokens=3)))[-1].usage.completion_tokens == 3


async def test_a_client_that_reads_nothing_is_cut_off_after_the_stall_limit():
    """Flow control holds the worker's writes once the client's window is full; past
    server.stall_timeout_s the stream ends RESOURCE_EXHAUSTED and its slot is free, while the
    engine's pending output for it stays one merged message (bounded by max_tokens)."""
    from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

    settings = {"server.stall_timeout_s": "1", "engine.args": "{tokens_per_s: 200000, max_model_len: 1000000, "
                "budget_tokens: 100000000}"}
    async with running_worker(**settings) as (worker, client):
        # A small receive window and no BDP growth, so a client that does not read fills it quickly.
        options = [("grpc.http2.lookahead_bytes", 16384), ("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(f"unix:{worker.config.server.socket}", options=options) as channel:
            call = pb_grpc.InferenceServiceStub(channel).StreamPredict(synthetic_request(max_tokens=400_000))
            assert (await call.read()).text
            started = time.monotonic()
            load = await client.wait_idle(timeout=10)  # read nothing meanwhile
            assert load.running == 0 and time.monotonic() - started < 8
            with pytest.raises(grpc.aio.AioRpcError) as error:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "read nothing" in error.value.details()
        assert await unfinished(client) == 0
        assert await client.status_of(synthetic_request()) == grpc.StatusCode.OK

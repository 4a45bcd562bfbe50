"""The trtllm engine adapter. Here against a TEST DOUBLE of tensorrt_llm 1.2 (tests/doubles): TensorRT-LLM
needs an NVIDIA GPU and multi-GB wheels, so the real integration test is marked `trtllm` and runs on a
GPU host with `pytest -m trtllm` (see the README)."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import grpc
import pytest

from tests.conftest import WorkerProcess, running_worker, synthetic_request
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

DOUBLES = Path(__file__).resolve().parent / "doubles"


@pytest.fixture
def trtllm_double(monkeypatch, embedded_model):
    if importlib.util.find_spec("tensorrt_llm") is not None and "doubles" not in str(importlib.util.find_spec("tensorrt_llm").origin):
        pytest.skip("the real tensorrt_llm is installed; the `trtllm` marked test covers it")
    monkeypatch.syspath_prepend(str(DOUBLES))
    for name in [n for n in sys.modules if n.startswith("tensorrt_llm")]:
        monkeypatch.delitem(sys.modules, name)
    import tensorrt_llm

    assert tensorrt_llm.__version__.endswith("test-double")
    return tensorrt_llm


def settings(embedded_model, **more):
    return {"engine.name": "trtllm", "engine.model": str(embedded_model), "engine.served_name": "smol", **more}


async def test_streams_and_reports_the_executors_kv_pool(trtllm_double, embedded_model):
    async with running_worker(**settings(embedded_model)) as (worker, client):
        responses = await client.collect(synthetic_request(max_tokens=12, return_token_ids=True))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 12 == sum(len(r.token_ids) for r in responses)
        assert responses[-1].usage.prompt_tokens == len(worker.engine.tokenizer("tell me a story")["input_ids"])
        load = await client.load()
        assert load.budget_tokens_total == 1000 * 32
        info = await client.control.GetInfo(pb.GetInfoRequest())
        assert (info.engine, list(info.models)) == ("trtllm", ["smol"])


async def test_presets_reach_the_llm_arguments(trtllm_double, embedded_model):
    extra = {"engine.args.max_num_seqs": "64", "engine.args.block_size": "64", "engine.args.gpu_memory_utilization": "0.8"}
    async with running_worker(**settings(embedded_model, **extra)) as (_, client):
        llm = trtllm_double.LLM.last
        assert (llm.max_batch_size, llm.tokens_per_block, llm.kv_cache_config.free_gpu_memory_fraction) == (64, 64, 0.8)
        assert (await client.load()).budget_tokens_total == 1000 * 64


async def test_abort_and_deadline_leave_nothing_in_the_executor(trtllm_double, embedded_model):
    async with running_worker(**settings(embedded_model)) as (worker, client):
        call = client.inference.StreamPredict(synthetic_request(max_tokens=5000))
        await call.read()
        call.cancel()
        await client.wait_idle()
        for _ in range(100):
            if not trtllm_double.LLM.last.active and worker.engine.num_unfinished() == 0:
                break
            await asyncio.sleep(0.01)
        assert not trtllm_double.LLM.last.active and worker.engine.num_unfinished() == 0
        assert await client.status_of(synthetic_request(max_tokens=5000), timeout=0.2) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (await client.wait_idle()).running == 0


async def test_executor_validation_errors_are_invalid_argument(trtllm_double, embedded_model):
    async with running_worker(**settings(embedded_model)) as (_, client):
        request = synthetic_request(max_tokens=4, sampling={"top_k": 5000, "temperature": 1.0})
        assert await client.status_of(request) == grpc.StatusCode.INVALID_ARGUMENT
        assert (await client.collect(synthetic_request(max_tokens=3)))[-1].usage.completion_tokens == 3


async def test_eos_ends_with_stop(trtllm_double, embedded_model):
    async with running_worker(**settings(embedded_model)) as (_, client):
        trtllm_double.LLM.last.eos_after = 4
        responses = await client.collect(pb.PredictRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=20)))
        assert responses[-1].finish_reason == pb.FINISH_REASON_STOP and responses[-1].usage.completion_tokens == 5


def test_unknown_llm_arguments_are_a_config_error(trtllm_double, embedded_model):
    from worker.config import ConfigError
    from worker.config_loader import load_config
    from worker.engines.trtllm import TRTLLMEngine

    config = load_config(None, {"HOME": "/tmp"}, {**settings(embedded_model), "engine.args.warp_drive": "1"})
    engine = TRTLLMEngine(config)
    with pytest.raises(ConfigError, match="engine.args"):
        asyncio.run(engine.load_model())


@pytest.mark.trtllm
def test_real_tensorrt_llm_answers_paris(embedded_model):
    """On an NVIDIA GPU host with `cy-llm setup --engine trtllm`: pytest -m trtllm."""
    worker = WorkerProcess("--engine", "trtllm", "--model", "smollm2-135m-instruct")
    try:
        worker.wait_ready(900)
        with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
            request = pb.PredictRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(
                role="user", content="What is the capital of France?")]), sampling=pb.SamplingParams(temperature=0, max_tokens=30))
            text = "".join(r.text for r in pb_grpc.InferenceServiceStub(channel).StreamPredict(request))
        assert "Paris" in text
    finally:
        worker.stop()

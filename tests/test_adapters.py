"""Prompt adapters: the knowledge base (FTS5, BM25, rebuilt without a restart), retrieval quality on a
small labelled set, the rag and system_prompt adapters, their statuses, and RAG end to end on the
embedded model."""

import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.conftest import running_worker, synthetic_request
from worker.adapters.base import AdapterError, AdapterInputError, build_adapters
from worker.adapters.knowledge_base import KnowledgeBase, KnowledgeBaseError, build_index, split_passages
from worker.cli import main as cli
from worker.config import ConfigError
from worker.config_loader import load_config
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.request import ChatMessage, GenerationRequest, SamplingParams

# One topic a file; each question's answer is in exactly one of them.
DOCS = {
    "harbour.md": "# Harbour\n\nThe Vellmoor lighthouse stands on the north pier and was lit in 1862. Its keeper "
                  "logs every ship that enters the harbour.",
    "bakery.txt": "The Copperleaf bakery opens at five in the morning. Its rye loaf uses a sourdough starter "
                  "kept alive since 1971.",
    "observatory.md": "The hill observatory houses a 60 centimetre reflecting telescope. Public viewing nights "
                      "are held on the first Friday of each month.",
    "tram.txt": "Line 7 of the city tram runs from the central station to the university every twelve minutes.",
    "library.md": "The municipal library lends seed packets as well as books; gardeners return seeds after "
                  "the harvest.",
    "festival.txt": "The lantern festival takes place on the river in late October; boats carry paper lanterns "
                    "downstream at dusk.",
    "zorblax.md": "Project notes.\n\nThe access code of the Zorblax vault is 4417. Only the night archivist "
                  "may open it.",
    "garden.txt": "The botanical garden's glasshouse keeps orchids at 24 degrees and cacti in a dry wing.",
}
LABELLED = [
    ("When was the Vellmoor lighthouse first lit?", "harbour.md"),
    ("How old is the bakery's sourdough starter?", "bakery.txt"),
    ("How big is the observatory telescope?", "observatory.md"),
    ("How often does tram line 7 run?", "tram.txt"),
    ("Can I borrow seeds at the library?", "library.md"),
    ("When is the lantern festival?", "festival.txt"),
    ("What is the access code of the Zorblax vault?", "zorblax.md"),
    ("At what temperature are the orchids kept?", "garden.txt"),
]


@pytest.fixture
def docs(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    return folder


def test_recall_at_3_on_a_labelled_set(docs, tmp_path):
    index = tmp_path / "kb" / "town.sqlite"
    seen = []
    assert build_index(docs, index, lambda done, total, passages: seen.append((done, total))) == len(DOCS)  # short paragraphs merge
    assert seen[-1] == (len(DOCS), len(DOCS))
    kb = KnowledgeBase(index)
    hits = [source in [p.source for p in kb.search(question, 3)] for question, source in LABELLED]
    recall = sum(hits) / len(hits)
    print(f"recall@3 = {recall:.3f} over {len(hits)} questions")
    assert recall >= 0.875
    assert kb.search("", 3) == [] and kb.search('"); DROP TABLE passages; --', 3) == []


def test_a_rebuilt_index_is_read_without_reopening(docs, tmp_path):
    index = tmp_path / "kb.sqlite"
    build_index(docs, index)
    kb = KnowledgeBase(index)
    assert kb.search("quokka", 3) == []
    (docs / "zoo.md").write_text("The quokka enclosure opened in spring.")
    build_index(docs, index)
    assert [p.source for p in kb.search("quokka", 3)] == ["zoo.md"]


def test_missing_or_empty_sources_are_clear_errors(tmp_path):
    with pytest.raises(KnowledgeBaseError, match="not a directory"):
        build_index(tmp_path / "nope", tmp_path / "kb.sqlite")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KnowledgeBaseError, match="holds no"):
        build_index(tmp_path / "empty", tmp_path / "kb.sqlite")
    with pytest.raises(KnowledgeBaseError, match="cy-llm kb index"):
        KnowledgeBase(tmp_path / "absent.sqlite").search("anything", 3)


def test_long_text_is_split_into_bounded_passages():
    text = "\n\n".join(["word " * 100] * 10) + "\n\n" + "x" * 3000
    passages = split_passages(text)
    assert all(len(p) <= 1200 for p in passages) and len(passages) >= 5
    assert "".join(passages).replace("\n", "").replace(" ", "") == text.replace("\n", "").replace(" ", "")


def request_with(prompt=None, messages=None, token_ids=None) -> GenerationRequest:
    return GenerationRequest(request_id="r", sampling=SamplingParams(), prompt=prompt, messages=messages,
                             prompt_token_ids=token_ids)


def test_rag_adapter_fills_the_prompt_or_the_system_message_within_budget(docs, tmp_path):
    build_index(docs, tmp_path / "town.sqlite")
    words = lambda text: len(text.split())  # noqa: E731 - a token counter for the test
    adapters = build_adapters({"town": {"type": "rag", "kb": "town", "top_k": 3, "max_context_tokens": 40}}, tmp_path)
    rag = adapters["town"]
    prepared = rag.prepare_prompt(request_with(prompt="What is the access code of the Zorblax vault?"), words)
    assert "4417" in prepared.prompt and prepared.prompt.rstrip().endswith("Zorblax vault?")
    context = prepared.prompt.split("Question:")[0]
    assert words(context) <= 40 + 12  # the passages within budget, plus the fixed lead-in
    chat = rag.prepare_prompt(request_with(messages=(ChatMessage("system", "Be brief."),
                                              ChatMessage("user", "When was the Vellmoor lighthouse lit?"))), words)
    assert chat.messages[0].role == "system" and "Be brief." in chat.messages[0].content
    assert "1862" in chat.messages[0].content and chat.messages[1].content.startswith("When was")
    assert rag.prepare_prompt(request_with(prompt="unrelated quasar"), words).prompt == "unrelated quasar"
    with pytest.raises(AdapterInputError):
        rag.prepare_prompt(request_with(token_ids=[1, 2]), words)
    missing = build_adapters({"gone": {"type": "rag", "kb": "gone"}}, tmp_path)["gone"]
    with pytest.raises(AdapterError) as error:
        missing.prepare_prompt(request_with(prompt="x y"), words)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_system_prompt_adapter():
    adapter = build_adapters({"pirate": {"type": "system_prompt", "text": "Talk like a pirate."}}, None)["pirate"]
    prepared = adapter.prepare_prompt(request_with(messages=(ChatMessage("user", "hi"),)), len)
    assert [m.role for m in prepared.messages] == ["system", "user"]
    assert adapter.prepare_prompt(request_with(prompt="hi"), len).prompt == "Talk like a pirate.\n\nhi"
    replace = build_adapters({"p": {"type": "system_prompt", "text": "New.", "replace": True}}, None)["p"]
    out = replace.prepare_prompt(request_with(messages=(ChatMessage("system", "Old."), ChatMessage("user", "hi"))), len)
    assert out.messages[0].content == "New."


@pytest.mark.parametrize(("spec", "key"), [
    ({"type": "magic"}, "adapters.named.a.type"),
    ({"type": "rag"}, "adapters.named.a.kb"),
    ({"type": "rag", "kb": "k", "top_k": 0}, "adapters.named.a.top_k"),
    ({"type": "rag", "kb": "k", "colour": "red"}, "adapters.named.a.colour"),
    ({"type": "system_prompt", "text": "t", "template": "no slot"}, "adapters.named.a.template"),
])
def test_bad_adapter_specs_name_the_key(spec, key):
    config = load_config(None, {"HOME": "/tmp"}, {"adapters.named.a": spec})  # the config holds specs only
    with pytest.raises(ConfigError) as error:
        build_adapters(config.adapters.named, Path(config.adapters.kb_dir))
    assert error.value.key == key


def test_serve_refuses_a_bad_adapter_spec_at_start_naming_the_key():
    result = subprocess.run([sys.executable, "-m", "worker", "serve", "--engine", "synthetic", "--socket",
                             "/tmp/cyllm-adapter-spec.sock", "--set", "adapters.named.a={type: rag, kb: k, top_k: 0}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "configuration error: adapters.named.a.top_k:" in result.stderr


def test_kb_cli_indexes_and_searches(docs, tmp_path, capsys):
    env = ["--set", f"adapters.kb_dir={tmp_path / 'kb'}"]
    assert cli(["kb", "index", str(docs), "--name", "town", *env]) == 0
    assert "indexed 8/8 files" in capsys.readouterr().err
    assert cli(["kb", "search", "town", "Zorblax vault code", *env]) == 0
    assert "[zorblax.md]" in capsys.readouterr().out
    assert cli(["kb", "index", str(docs), "--name", "../escape", *env]) == 2


async def test_adapter_statuses_and_slots_through_the_worker(docs, tmp_path):
    build_index(docs, tmp_path / "town.sqlite")
    named = {"town": {"type": "rag", "kb": "town"}, "gone": {"type": "rag", "kb": "gone"},
             "pirate": {"type": "system_prompt", "text": "Talk like a pirate."}}
    async with running_worker(**{"adapters.kb_dir": str(tmp_path), "adapters.named": named}) as (worker, client):
        info = await client.control.GetInfo(pb.GetInfoRequest())
        assert list(info.adapters) == ["gone", "pirate", "town"]
        assert await client.status_of(synthetic_request(adapter="nope")) == grpc.StatusCode.NOT_FOUND
        assert await client.status_of(synthetic_request(adapter="gone")) == grpc.StatusCode.FAILED_PRECONDITION
        tokens = synthetic_request(adapter="town")
        tokens.ClearField("prompt")
        tokens.token_ids.ids.extend([1, 2, 3])
        assert await client.status_of(tokens) == grpc.StatusCode.INVALID_ARGUMENT
        plain = (await client.collect(synthetic_request(prompt="Zorblax vault code")))[-1].usage.prompt_tokens
        rag = (await client.collect(synthetic_request(prompt="Zorblax vault code", adapter="town")))[-1].usage.prompt_tokens
        assert rag > plain
        assert (await client.wait_idle()).running == 0


async def test_process_output_rewrites_each_message_and_a_failure_is_one_requests_status():
    from worker.adapters.base import Adapter

    class Shout(Adapter):
        kind = "shout"

        def prepare_prompt(self, request, count_tokens):
            return request

        def process_output(self, output):
            if "boom" in output.text:
                raise AdapterError("the shout adapter cannot take this output")
            output.text = output.text.upper()
            return output

    async with running_worker() as (worker, client):
        worker.inference.adapters["shout"] = Shout("shout")
        plain = "".join(r.text for r in await client.collect(synthetic_request(max_tokens=12)))
        loud = "".join(r.text for r in await client.collect(synthetic_request(max_tokens=12, adapter="shout")))
        assert plain and loud == plain.upper() != plain
        worker.inference.adapters["shout"].process_output = lambda output: (_ for _ in ()).throw(AdapterError("broken"))
        assert await client.status_of(synthetic_request(adapter="shout")) == grpc.StatusCode.FAILED_PRECONDITION
        assert (await client.wait_idle()).running == 0
        assert await client.status_of(synthetic_request()) == grpc.StatusCode.OK


async def test_rag_answers_from_the_knowledge_base_on_the_embedded_model(docs, tmp_path, embedded_model, capfd):
    build_index(docs, tmp_path / "town.sqlite")
    settings = {"engine.name": "transformers", "engine.model": str(embedded_model), "server.log_level": "debug",
                "adapters.kb_dir": str(tmp_path), "adapters.named": {"town": {"type": "rag", "kb": "town"}}}
    question = "What is the access code of the Zorblax vault?"
    async with running_worker(**settings) as (worker, client):
        def ask(adapter: str) -> pb.PredictRequest:
            return pb.PredictRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=question)]),
                                     adapter=adapter, sampling=pb.SamplingParams(temperature=0, max_tokens=24))

        without = await client.collect(ask(""))
        capfd.readouterr()
        answer = await client.collect(ask("town"))
        logged = capfd.readouterr()
        text = "".join(r.text for r in answer)
        assert answer[-1].usage.prompt_tokens > without[-1].usage.prompt_tokens + 15
        assert "4417" in text, text
        assert "4417" not in "".join(r.text for r in without)
        assert (await client.wait_idle()).running == 0
    # The debug log echoes the prompt the adapter built (never at INFO: prompts stay out of logs).
    assert re.search(r"adapter prepared the request.*4417", logged.out + logged.err)


def test_openai_clients_name_an_adapter_with_a_header(worker_process, sidecar):
    import openai

    worker = worker_process("--engine", "synthetic", "--set", "engine.served_name=synthetic",
                            "--set", "adapters.named.long={type: system_prompt, text: " + "a b c d e f g h " * 8 + "}")
    worker.wait_ready()
    front = sidecar([worker.socket_path])
    front.wait_ready()
    client = openai.OpenAI(base_url=f"{front.http}/v1", api_key="unused", max_retries=0)
    ask = dict(model="synthetic", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    plain = client.chat.completions.create(**ask).usage.prompt_tokens
    adapted = client.chat.completions.create(**ask, extra_headers={"x-cyllm-adapter": "long"}).usage.prompt_tokens
    assert adapted > plain + 30
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**ask, extra_headers={"x-cyllm-adapter": "none-such"})

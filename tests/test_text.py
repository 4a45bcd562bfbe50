"""Tokenizer loading, sampling and detokenization: the pieces the engines share."""

import time

import pytest
import torch

from worker.engines.detokenizer import IncrementalDetokenizer, OutputText, StopStrings
from worker.engines.sampler import Draws, argmax, make_generator, sample
from worker.request import SamplingParams


def test_stop_strings_cut_the_text_and_hold_back_a_possible_start():
    stops = StopStrings(("END",))
    assert stops.add("hello E") == "hello "  # "E" may begin "END"
    assert stops.add("x") == "Ex"
    assert stops.add(" and EN") == " and "
    assert stops.add("D more") == ""
    assert stops.stopped and stops.flush() == ""


def test_stop_strings_flush_the_held_tail_at_the_end():
    stops = StopStrings(("###",))
    assert stops.add("a#") == "a"
    assert not stops.stopped and stops.flush() == "#"


def test_no_stop_strings_pass_text_through():
    assert StopStrings(()).add("anything") == "anything"


class ByteTokenizer:
    """A byte-level stand-in: one token per UTF-8 byte, decoded with replacement like HF tokenizers."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_splits_a_character():
    text = "héllo 🙂 世界!"
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), list(b"> "))
    deltas = [detokenizer.add(b) for b in text.encode()] + [detokenizer.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) > 5


@pytest.mark.parametrize("end", ["stop", "length"])
def test_text_left_to_the_reader_is_the_text_made_in_place(end):
    """An engine in its own process leaves a request's text to the worker (process.py): its
    OutputText gives the finish reasons and no text, and the worker's, over the same messages,
    the text the engine would have made, characters cut across messages included."""
    eos = 0
    ids = list("héllo 🙂 世界!".encode()) + ([eos] if end == "stop" else [])
    messages = [ids[:2], ids[2:3], ids[3:8], ids[8:13], ids[13:]]  # cuts inside é, 🙂 and 世
    in_place, left, reader = (OutputText(ByteTokenizer(), list(b"> "), (), frozenset({eos}), render=render)
                              for render in (True, False, True))
    for index, chunk in enumerate(messages):
        at_limit = index == len(messages) - 1 and end == "length"
        text, finish, taken = in_place.add_all(chunk, (), False, at_limit)
        assert left.add_all(chunk, (), False, at_limit) == ("", finish, taken)
        assert reader.add_all(chunk, (), False, finish == "length")[0] == text
    assert finish == end
    assert OutputText(ByteTokenizer(), [], ("!",), frozenset(), render=False).render  # stop strings need the text


@pytest.mark.model
@pytest.mark.parametrize("cut", [0, 1], ids=["whole", "less-the-last-token"])
def test_the_stream_decoder_gives_what_the_window_decoder_gives(embedded_model, cut):
    """A fast tokenizer streams through tokenizers' DecodeStream: the same deltas, token by token,
    as decoding windows of ids, byte-level pieces of characters and an end mid-character included."""
    from worker.engines.prompt import load_tokenizer

    tokenizer = load_tokenizer(embedded_model)
    prompt = tokenizer("Answer:")["input_ids"]
    ends = []
    for text in (" héllo wörld, 1234 🙂\n\tdone", " 世界 — naïve café 🧑‍🍳!", " def f(x):\n    return x  # ok", "🙂🙂"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = ids[:len(ids) - cut]
        ends.append(tokenizer.decode(ids)[-1:])
        streamed, windowed = IncrementalDetokenizer(tokenizer, prompt), IncrementalDetokenizer(tokenizer, prompt)
        assert streamed._stream is not None
        windowed._stream = None
        deltas = [(streamed.add(i), windowed.add(i)) for i in ids] + [(streamed.flush(), windowed.flush())]
        assert [a for a, _ in deltas] == [b for _, b in deltas], text
        assert "".join(a for a, _ in deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert ("\ufffd" in ends) == bool(cut)  # "🙂🙂" less its last token ends inside the second one


def test_greedy_and_top_k_one_agree():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    greedy = [SamplingParams()] * 3
    gens = [make_generator(p) for p in greedy]
    expected = logits.argmax(-1).tolist()
    assert sample(logits.clone(), greedy, gens, [[]] * 3, [[]] * 3).tolist() == expected
    top1 = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(3)]
    gens = [make_generator(p) for p in top1]
    assert sample(logits.clone(), top1, gens, [[]] * 3, [[]] * 3).tolist() == expected


def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    logits = torch.zeros(1, 50)
    params = SamplingParams(temperature=1.0, seed=42)

    def draw(batch_rows):
        # Neighbours with and without top-p: only rows that truncate are sorted.
        rows = [params] + [SamplingParams(temperature=1.0, seed=s, top_p=0.9 if s % 2 else 1.0) for s in range(batch_rows)]
        gens = [make_generator(p) for p in rows]
        out = []
        for _ in range(20):
            batch = logits.repeat(len(rows), 1)
            out.append(sample(batch, rows, gens, [[]] * len(rows), [[]] * len(rows))[0].item())
        return out

    assert draw(0) == draw(3)
    assert len(set(draw(0))) > 5


def test_a_request_s_draws_run_on_across_blocks_and_repeat_with_its_seed():
    """Draws come a block at a time from the request's own generator: one stream, the same for a
    seed however the draws are taken, and none repeated where a block ends."""
    first = Draws(5)
    taken = [first.next() for _ in range(2 * Draws.BLOCK + 3)]
    assert len(set(taken)) == len(taken) and all(0.0 <= x < 1.0 for x in taken)
    again = Draws(5)
    assert [again.next() for _ in range(len(taken))] == taken
    assert Draws(6).next() != taken[0]


@pytest.mark.parametrize("top_p", [1.0, 0.999], ids=["unsorted", "sorted"])
def test_draws_follow_the_probabilities(top_p):
    """Both ways of drawing (rows that truncate are sorted first) draw each token at its probability."""
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=3)
    gen = make_generator(params)
    draws = [sample(logits.clone(), [params], [gen], [[]], [[]]).item() for _ in range(3000)]
    assert [round(draws.count(token) / len(draws), 1) for token in range(3)] == [0.6, 0.3, 0.1]


def test_top_p_and_min_p_keep_only_the_head():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for params in (SamplingParams(temperature=1.0, top_p=0.5, seed=1), SamplingParams(temperature=1.0, min_p=0.7, seed=1)):
        gen = make_generator(params)
        assert {sample(logits.clone(), [params], [gen], [[]], [[]]).item() for _ in range(50)} == {0}


def test_penalties_move_probability_away_from_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    params = SamplingParams(repetition_penalty=2.0)
    gen = make_generator(params)
    assert sample(logits.clone(), [params], [gen], [[0]], [[]]).tolist() == [1]
    params = SamplingParams(presence_penalty=0.5)
    assert sample(logits.clone(), [params], [gen], [[]], [[0]]).tolist() == [1]
    params = SamplingParams(frequency_penalty=0.05)
    assert sample(logits.clone(), [params], [gen], [[]], [[0]]).tolist() == [0]
    assert sample(logits.clone(), [params], [gen], [[]], [[0, 0, 0]]).tolist() == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the chunked argmax runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 64], ids=["few-rows", "many-rows"])
def test_chunked_argmax_finds_each_rows_first_maximum(dtype, rows):
    logits = torch.randn(rows, 128256, device="cuda", dtype=dtype)
    logits[1, 5000] = logits[1, 90000] = 100  # a tie across chunks: the first one wins, as torch.argmax
    logits[2, -1] = 100  # in the last chunk, which is shorter than the others
    logits[3, 7] = logits[3, 9] = 100  # a tie inside a chunk
    logits[4] = float("-inf")  # every token masked but the last
    logits[4, -1] = 0
    expected = [logits[0].float().argmax().item(), 5000, 128255, 7, 128255]
    assert argmax(logits).tolist() == logits.float().argmax(dim=-1).tolist()
    assert argmax(logits).tolist()[:5] == expected
    assert argmax(logits[:, :100000]).tolist() == logits[:, :100000].float().argmax(dim=-1).tolist()  # strided rows


@pytest.mark.model
def test_load_tokenizer_reads_a_generic_tokenizer_as_auto_tokenizer_does(embedded_model):
    from transformers import AutoTokenizer

    from worker.engines.prompt import encode_prompt, load_tokenizer
    from worker.request import ChatMessage, GenerationRequest

    fast, auto = load_tokenizer(embedded_model), AutoTokenizer.from_pretrained(embedded_model)
    assert type(fast) is type(auto) and fast.eos_token_id == auto.eos_token_id
    for request in (GenerationRequest(request_id="t", sampling=SamplingParams(), prompt="héllo wörld, 1234 🙂\n\tdone"),
                    GenerationRequest(request_id="c", sampling=SamplingParams(), messages=(ChatMessage("system", "Be brief."),
                                                                ChatMessage("user", "What is the capital of France?")))):
        ids = encode_prompt(fast, request)
        assert ids == encode_prompt(auto, request)
        assert fast.decode(ids) == auto.decode(ids)


@pytest.mark.model
def test_prompts_are_encoded_by_the_backend_only_where_it_gives_the_tokenizers_ids(embedded_model):
    """encode_text(): the Rust backend's encode where it agrees with the tokenizer's __call__ on the
    probes, with and without special tokens; __call__ itself for one that adds something of its own."""
    from worker.engines.prompt import backend_agrees, encode_text, load_tokenizer

    tokenizer = load_tokenizer(embedded_model)
    assert backend_agrees(tokenizer)
    for text in ("<|im_start|>user\nhi<|im_end|>", " héllo wörld, 1234 🙂\n\tdone", "  two", ""):
        for special in (True, False):
            assert encode_text(tokenizer, text, special) == tokenizer(text, add_special_tokens=special)["input_ids"]

    def prefixed(text, add_special_tokens):  # a tokenizer whose Python adds a token the backend does not
        return {"input_ids": [0] * add_special_tokens + tokenizer(text, add_special_tokens=False)["input_ids"]}

    odd = type("Odd", (), {"__call__": lambda self, text, add_special_tokens: prefixed(text, add_special_tokens),
                           "backend_tokenizer": tokenizer.backend_tokenizer, "all_special_tokens": []})()
    assert not backend_agrees(odd)
    assert encode_text(odd, "hi", True) == [0] + tokenizer("hi", add_special_tokens=False)["input_ids"]


@pytest.mark.model
def test_the_native_engine_loads_without_importing_torch_dynamo(embedded_model):
    # AutoTokenizer (through transformers 5's config imports) and random init on the meta device
    # both import torch._dynamo: 1.5 s of a start that takes about 1.3 s without it.
    import subprocess
    import sys

    code = ("import sys, torch; from pathlib import Path; from worker.engines.native.model import load_model; "
            "from worker.engines.prompt import load_tokenizer; folder = Path(sys.argv[1]); "
            "load_model(folder, torch.float32, torch.device('cpu')); load_tokenizer(folder); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(embedded_model)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's stream is what a copy from pageable memory waits for")
def test_sampling_on_cuda_is_queued_without_waiting_for_the_device():
    """A step launched ahead samples its rows while its forward runs: the temperatures, the rows'
    indices, top-k / top-p / min-p and each row's draw go over from pinned memory. Built with
    torch.tensor(..., device=...), each waited for the forward first, and sampled decoding ran at
    0.6-0.8x the rate it has now (H100, SmolLM2's shape, batch 1-64)."""
    params = [SamplingParams(temperature=0.8, seed=s, top_p=0.9 if s % 2 else 1.0, min_p=0.01 * (s == 2))
              for s in range(4)]
    logits = torch.randn(4, 1000, device="cuda")
    gens = [make_generator(p) for p in params]
    sample(logits.clone(), params, gens, [[]] * 4, [[]] * 4)  # first pinned allocations, kernel loads
    expected = sample(logits.clone(), params, [make_generator(p) for p in params], [[]] * 4, [[]] * 4)
    gens = [make_generator(p) for p in params]
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the stream's time, before sampling is queued
    started = time.monotonic()
    tokens = sample(logits.clone(), params, gens, [[]] * 4, [[]] * 4)
    waited = time.monotonic() - started
    assert waited < 0.2, f"sampling waited {waited:.2f} s for the stream"
    assert tokens.tolist() == expected.tolist(), "the same seeds draw the same tokens"

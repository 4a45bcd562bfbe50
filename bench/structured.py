"""Structured output's cost on the native engine: tokens/s with a json_schema constraint against none,
the same chat prompts (free text to max_tokens; the schema's JSON is too long to end before it, each
stream's length is recorded), at batch 1 and 8 (or the sizes given), in one run with the two alternated
round by round (a shared machine's slow spell falls on both); and the schema's compile time, first
and cached. Tokens/s is completion tokens over the batch's wall time, prefill included. The engine
runs in this process, all of a batch's requests submitted at once.

--random-weights keeps the model's config and tokenizer and draws new weights: the same shapes and
so the same speed, for a GPU host the converted weights cannot travel to. Its text is noise, but
the grammar still decides every constrained token.

Writes bench/results/structured_<device>.json and .png.

    python bench/structured.py [--device cpu|cuda] [--batches 1,8] [--repeats 3] [--max-tokens 128]
                               [--model NAME|FOLDER] [--random-weights]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULTS = REPO / "bench" / "results"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"}, "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror", "documentary", "romance"]}},
        # 40 members at least: no JSON can end before about 400 tokens, so every stream runs to
        # max_tokens, as the free ones do, whatever the weights.
        "cast": {"type": "array", "minItems": 40, "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"type": "string"}}, "required": ["name", "role"]}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "genres", "cast", "summary"],
}
# Short enough for every stream to end, random weights or not: its JSON checks the masks (CUDA too).
CHECK_SCHEMA = {
    "type": "object",
    "properties": {"genres": SCHEMA["properties"]["genres"] | {"minItems": 1, "maxItems": 3},
                   "rating": {"enum": [1, 2, 3, 4, 5]}, "seen": {"type": "boolean"}},
    "required": ["genres", "rating", "seen"], "additionalProperties": False,
}
PROMPT = "Describe a film you like, with its cast and a long summary, as JSON."


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--random-weights", action="store_true")
    options = parser.parse_args()
    folder = model_folder(options.model)
    batches = [int(b) for b in options.batches.split(",")]
    with tempfile.TemporaryDirectory() as work:
        if options.random_weights:
            folder = random_weights(folder, Path(work), options.device)
        compile_ms = compile_times(folder)
        rows, check, dtype = asyncio.run(measure(folder, options, batches))
        random = drawn_at_random(folder)
    result = {"benchmark": "structured", "device": options.device, "machine": machine(options.device),
              "when": time.strftime("%Y-%m-%d %H:%M"), "model": options.model, "dtype": dtype,
              "random_weights": random, "max_tokens": options.max_tokens, "schema": SCHEMA,
              "compile_ms": compile_ms, "check": check, "rows": rows,
              "targets": {"ratio": 0.9 if options.device == "cpu" else 0.95}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"structured_{options.device}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    for row in rows:
        print(f"batch {row['batch']}: free {row['free_tokens_per_s']:.1f} tok/s, json_schema "
              f"{row['constrained_tokens_per_s']:.1f} tok/s, ratio {row['ratio']:.3f} {[round(r, 3) for r in row['ratios']]}")
    print(f"compile: {compile_ms}")
    return 0


async def measure(folder: Path, options, batches: list[int]) -> tuple[list[dict], dict, str]:
    from bench.native_burst import unload
    from worker.config_loader import load_config
    from worker.engines.hosted import settle
    from worker.engines.native.engine import NativeEngine
    from worker.request import ChatMessage, Constraint, GenerationRequest, SamplingParams

    config = load_config(None, {"HOME": "/tmp"}, {
        "engine.name": "native", "engine.model": str(folder), "engine.device": options.device,
        "engine.args": json.dumps({"max_num_seqs": max(batches)})})
    engine = NativeEngine(config)
    await engine.load_model()
    settle()

    def request(seed: int, constrained: bool, max_tokens: int, schema: dict = SCHEMA) -> GenerationRequest:
        # Free text runs to max_tokens (ignore_eos), as the long JSON does, so the two batches keep
        # their streams equally long; a constraint cannot take ignore_eos.
        req = GenerationRequest(
            request_id=f"s{seed}-{int(constrained)}", messages=(ChatMessage(role="user", content=PROMPT),),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                                    ignore_eos=not constrained),
            constraint=Constraint("json_schema", json.dumps(schema)) if constrained else None)
        req.prompt_token_ids = engine.encode(req)
        engine.prepare(req)
        return req

    async def one(req: GenerationRequest) -> tuple[int, str, str]:
        tokens, text, finish = 0, "", ""
        async for out in engine.stream_predict(req):
            tokens, text, finish = tokens + len(out.token_ids), text + out.text, out.finish_reason or finish
        return tokens, text, finish

    async def run(batch: int, constrained: bool, round_: int, schema: dict = SCHEMA) -> dict:
        requests = [request(1000 * round_ + i, constrained, options.max_tokens, schema) for i in range(batch)]
        started = time.perf_counter()
        replies = await asyncio.gather(*(one(r) for r in requests))
        wall = time.perf_counter() - started
        lengths = [tokens for tokens, _, _ in replies]
        result = {"tokens": sum(lengths), "seconds": wall, "tokens_per_s": sum(lengths) / wall, "lengths": lengths}
        if constrained:  # the JSON of streams that ended before max_tokens is whole: it must validate
            whole = [text for _, text, finish in replies if finish == "stop"]
            result.update(ended=len(whole), valid=sum(valid(text, schema) for text in whole))
        return result

    try:
        # Warm: the step paths run once, the device's graphs captured; and the masks checked.
        check = await run(max(batches), True, 99, CHECK_SCHEMA)
        print(f"check: {check['valid']} of {check['ended']} ended streams valid (of {max(batches)})", flush=True)
        await run(max(batches), False, 98)
        rows = []
        for batch in batches:
            runs = {False: [], True: []}
            for round_ in range(options.repeats):
                for constrained in (False, True):
                    runs[constrained].append(await run(batch, constrained, round_))
            ratios = [c["tokens_per_s"] / f["tokens_per_s"] for f, c in zip(runs[False], runs[True])]
            rows.append({"batch": batch,
                         "free_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[False]),
                         "constrained_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[True]),
                         "ratio": statistics.median(ratios), "ratios": ratios,
                         "runs": {"free": runs[False], "json_schema": runs[True]}})
            print(f"batch {batch}: ratios {[round(r, 3) for r in ratios]}", flush=True)
        return rows, {k: check[k] for k in ("lengths", "ended", "valid")}, str(engine.k_cache.dtype).removeprefix("torch.")
    finally:
        await unload(engine)


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def model_folder(model: str) -> Path:
    """A model folder, or the embedded model's name prepared under CYLLM_CACHE_DIR (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from worker.models import locate_model

    return Path(model) if Path(model).is_dir() else locate_model(
        model, os.environ.get("CYLLM_CACHE_DIR", str(Path.home() / ".cache" / "cy-llm" / "models")))


RANDOM_MARK = "random-weights.json"
"""Written into a folder random_weights() makes, so a bench given that folder as --model still says
its weights were random."""


def random_weights(folder: Path, work: Path, device: str) -> Path:
    """A copy of the model folder (config, tokenizer, template) with freshly drawn weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = work / folder.name
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.gguf", "*.index.json"))
    torch.manual_seed(0)
    with torch.device("cuda" if device.startswith("cuda") else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.save_pretrained(out)
    (out / RANDOM_MARK).write_text(json.dumps({"from": str(folder), "seed": 0}))
    return out


def drawn_at_random(folder: Path) -> bool:
    """Whether the folder's weights came from random_weights() (in this run or an earlier one)."""
    return (folder / RANDOM_MARK).exists()


def compile_times(folder: Path) -> dict:
    """The schema compiled for the model's tokenizer, in a compiler of its own: first, then from its cache."""
    from worker.engines.grammar import Grammars
    from worker.engines.prompt import load_tokenizer
    from worker.request import Constraint

    tokenizer = load_tokenizer(folder)
    started = time.perf_counter()
    grammars = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    tokenizer_ms = (time.perf_counter() - started) * 1000
    times = []
    for _ in range(2):
        started = time.perf_counter()
        grammars.compile(Constraint("json_schema", json.dumps(SCHEMA)))
        times.append((time.perf_counter() - started) * 1000)
    return {"tokenizer_info_ms": round(tokenizer_ms, 2), "first_ms": round(times[0], 3), "cached_ms": round(times[1], 3)}


def machine(device: str) -> dict:
    info = {"cores": os.cpu_count(), "cpu": "unknown", "cpu_flags": []}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            info["cpu"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            info["cpu_flags"] = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))
            break
    if device == "cuda":
        import torch

        from bench.gpu_power import limits

        info["gpu"] = torch.cuda.get_device_name(0)
        info.update(limits())
    return info


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"batch {r['batch']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [r["free_tokens_per_s"] for r in rows], 0.4, label="no constraint")
    ax.bar([i + 0.2 for i in x], [r["constrained_tokens_per_s"] for r in rows], 0.4, label="json_schema")
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["constrained_tokens_per_s"], f"{r['ratio']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"native, {result['device']}: {result['machine'].get('gpu', result['machine']['cpu'])}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())

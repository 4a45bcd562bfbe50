"""What every step of the container run shares: names, the command runner, checks, timings, waits."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("CYLLM_CONTAINER_CACHE", Path.home() / ".cache" / "cy-llm" / "container"))
BASE = "localhost/cy-llm-base:bookworm"
RUST = "localhost/cy-llm-rust:local"
PROMETHEUS = "localhost/cy-llm-prometheus:local"
IMAGE = "localhost/cy-llm:ci"
SIDECAR_IMAGE = "localhost/cy-llm-sidecar:ci"

timings: dict[str, float] = {}


@contextmanager
def step(name: str):
    print(f"== {name}", flush=True)
    started = time.monotonic()
    yield
    timings[name] = round(time.monotonic() - started, 1)
    print(f"   {name}: {timings[name]} s", flush=True)


def run(*args: str, check: bool = True, capture: bool = False, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(args, text=True, capture_output=capture, env=env, **kw)
    if check and result.returncode != 0:
        detail = f"\n{result.stdout}\n{result.stderr}" if capture else ""
        raise SystemExit(f"failed ({result.returncode}): {' '.join(args)}{detail}")
    return result


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SystemExit(f"check failed: {message}")
    print(f"   ok: {message}", flush=True)


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def wait_for(what: str, probe, timeout_s: float, every_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = probe()
        if result:
            return result
        time.sleep(every_s)  # polling a service from outside: there is no event to wait on
    raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")

"""Hardening figures: a worker that stops answering, and a flood of slow clients, through the sidecar.

1. Two synthetic workers behind one sidecar (default flags); requests back to back. One worker is
   stopped (SIGSTOP): the time until the sidecar takes it out of routing, the slowest request
   meanwhile (one sent to it just before is retried on the other) and the retries; then the other
   is stopped too: the time until /readyz answers 503. Both are continued (SIGCONT) and the time
   until /readyz is 200 again is taken.
2. --connections slow clients on the HTTP port (a third idle, a third sending a request head that
   never ends, a third a body that never ends), with the default limits: the sidecar's RSS and file
   descriptors before and with all of them open, how long each kind was held, and a normal
   request's latency without and during the flood.

Writes bench/results/hardening.json and .png.

    python bench/hardening.py [--connections 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.sidecar import free_port, sidecar_binary  # noqa: E402
from bench.soak import fds, rss_mb, start_worker  # noqa: E402

RESULTS = REPO / "bench" / "results"
KINDS = {
    "idle": b"",
    "slow_head": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
    "slow_body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"pro",
}


class Sidecar:
    def __init__(self, sockets: list[str]):
        self.http, self.grpc, self.metrics = free_port(), free_port(), free_port()
        self.proc = subprocess.Popen(
            [str(sidecar_binary()), "--grpc-addr", f"127.0.0.1:{self.grpc}", "--http-addr", f"127.0.0.1:{self.http}",
             "--metrics-addr", f"127.0.0.1:{self.metrics}", "--log", "warn", *(f"--worker=unix://{s}" for s in sockets)])
        self.wait_status(200, 60)

    def readyz(self) -> tuple[int, dict]:
        try:
            reply = httpx.get(f"http://127.0.0.1:{self.http}/readyz", timeout=2)
            return reply.status_code, reply.json()
        except httpx.HTTPError:
            return 0, {}

    def wait_status(self, status: int, limit_s: float) -> float:
        started = time.monotonic()
        while self.readyz()[0] != status:
            if time.monotonic() - started > limit_s:
                raise TimeoutError(f"/readyz not {status} in {limit_s} s")
            time.sleep(0.02)
        return time.monotonic() - started

    def complete(self, timeout: float = 60.0) -> float:
        started = time.perf_counter()
        reply = httpx.post(f"http://127.0.0.1:{self.http}/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                           timeout=timeout)
        reply.raise_for_status()
        return time.perf_counter() - started

    def retries(self) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("cyllm_sidecar_retries_total"))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def hung_worker(sockets: list[str], workers: list[subprocess.Popen]) -> dict:
    front = Sidecar(sockets)
    latencies, stop = [], threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            latencies.append((time.monotonic(), front.complete()))

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    time.sleep(2)
    workers[0].send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    while next(w for w in front.readyz()[1]["workers"] if w["name"] == "w0")["ready"]:
        time.sleep(0.02)
    out_of_routing_s = time.monotonic() - stopped_at
    time.sleep(8)
    stop.set()
    thread.join(60)
    after = [latency for sent, latency in latencies if sent >= stopped_at - 0.5]
    workers[1].send_signal(signal.SIGSTOP)
    unready_s = front.wait_status(503, 30)
    for worker in workers:
        worker.send_signal(signal.SIGCONT)
    ready_again_s = front.wait_status(200, 30)
    result = {
        "stopped_worker_out_of_routing_s": round(out_of_routing_s, 3),
        "requests_after_sigstop": len(after),
        "slowest_request_after_sigstop_s": round(max(after), 3),
        "median_request_after_sigstop_s": round(statistics.median(after), 4),
        "retries": front.retries(),
        "both_stopped_readyz_503_s": round(unready_s, 3),
        "sigcont_readyz_200_s": round(ready_again_s, 3),
    }
    front.stop()
    return result


def flood(sockets: list[str], connections: int) -> dict:
    front = Sidecar(sockets)
    pid = front.proc.pid
    quiet = [front.complete() for _ in range(20)]
    before = {"rss_mb": round(rss_mb(pid), 1), "fds": fds(pid)}
    opened: dict[socket.socket, tuple[str, float]] = {}
    for index in range(connections):
        kind = list(KINDS)[index % len(KINDS)]
        connection = socket.create_connection(("127.0.0.1", front.http), timeout=5)
        if KINDS[kind]:
            connection.sendall(KINDS[kind])
        connection.setblocking(False)
        opened[connection] = (kind, time.monotonic())
    time.sleep(1)
    during_flood = {"rss_mb": round(rss_mb(pid), 1), "fds": fds(pid)}
    loaded = [front.complete() for _ in range(20)]
    held: dict[str, list[float]] = {kind: [] for kind in KINDS}
    answered_408 = 0
    deadline = time.monotonic() + 120
    while opened and time.monotonic() < deadline:
        readable, _, _ = select.select(list(opened), [], [], 0.5)
        for connection in readable:
            try:
                data = connection.recv(4096)
            except ConnectionError:
                data = b""
            if data:
                answered_408 += data.startswith(b"HTTP/1.1 408")
                continue
            kind, started = opened.pop(connection)
            held[kind].append(time.monotonic() - started)
            connection.close()
    after = {"rss_mb": round(rss_mb(pid), 1), "fds": fds(pid)}
    front.stop()
    return {
        "connections": connections, "still_open_after_120_s": len(opened), "answered_408": answered_408,
        "sidecar_before": before, "sidecar_with_all_open": during_flood, "sidecar_after": after,
        "held_s": {kind: {"min": round(min(v), 2), "median": round(statistics.median(v), 2), "max": round(max(v), 2),
                          "count": len(v)} for kind, v in held.items() if v},
        "request_latency_s": {
            "without_flood": {"p50": round(statistics.median(quiet), 4), "max": round(max(quiet), 4)},
            "during_flood": {"p50": round(statistics.median(loaded), 4), "max": round(max(loaded), 4)}},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (hung, held, latency) = plt.subplots(1, 3, figsize=(14, 4))
    hung_figures = result["hung_worker"]
    names = ["out of routing", "slowest request", "both: 503", "SIGCONT: 200"]
    values = [hung_figures[k] for k in ("stopped_worker_out_of_routing_s", "slowest_request_after_sigstop_s",
                                        "both_stopped_readyz_503_s", "sigcont_readyz_200_s")]
    hung.bar(names, values)
    hung.set_ylabel("seconds after the signal")
    hung.set_title("a worker stopped (SIGSTOP)")
    hung.tick_params(axis="x", labelsize=8)
    kinds = result["slow_clients"]["held_s"]
    held.bar(list(kinds), [kinds[k]["max"] for k in kinds])
    held.set_ylabel("longest hold, s")
    held.set_title(f"{result['slow_clients']['connections']} slow connections, default limits")
    lat = result["slow_clients"]["request_latency_s"]
    latency.bar(["without", "during flood"], [lat["without_flood"]["p50"] * 1000, lat["during_flood"]["p50"] * 1000])
    latency.set_ylabel("request p50, ms")
    latency.set_title("a normal request (4 tokens)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="cyllm-hard-", dir="/tmp"))
    sockets = [str(folder / f"w{i}.sock") for i in range(2)]
    workers = [start_worker(s) for s in sockets]
    try:
        result = {
            "benchmark": "hardening", "when": time.strftime("%Y-%m-%d %H:%M"),
            "machine": {"cpu": _cpu_model(), "cores": os.cpu_count()},
            "hung_worker": hung_worker(sockets, workers),
            "slow_clients": flood(sockets[:1], args.connections),
        }
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGCONT)
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hardening.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "hardening.png")
    print(json.dumps(result, indent=2))
    return 0


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())

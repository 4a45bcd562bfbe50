"""Tracing on (every request sampled, exported over OTLP) against off, in one run.

Two stacks of a synthetic worker (100k tokens/s) behind a sidecar, one exporting every span of
every request to a real OTLP receiver (tests/otlp.py, in a process of its own), the other not:

1. tokens/s at 64 streams (200k tokens shared), the median of --repeats runs of each, alternated;
2. one-token round trips one after another (the cost per request, where a span's is paid).

Writes bench/results/tracing.json and tracing.png. Needs `cargo build --release` of sidecar/.

    python bench/tracing.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.sidecar import Stack, round_trips  # noqa: E402
from bench.structured import machine  # noqa: E402
from bench.transport import SYNTHETIC, bench_once, middle  # noqa: E402
from worker.loadgen import percentile  # noqa: E402

RESULTS = REPO / "bench" / "results"
RECEIVER = ("import sys; from tests.otlp import Receiver; r = Receiver(); print(r.port, flush=True); "
            "sys.stdin.read(); print(len(r.spans), r.exports, flush=True)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--round-trips", type=int, default=500)
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    port = int(receiver.stdout.readline())
    traced_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_TRACES_SAMPLER_ARG": "1.0"}
    stacks = {"off": Stack(SYNTHETIC), "on": Stack(SYNTHETIC, env=traced_env)}
    result: dict = {"benchmark": "tracing", "machine": machine("cpu"), "when": time.strftime("%Y-%m-%d %H:%M"),
                    "sample_ratio": 1.0}
    try:
        streams = 64
        common = ["--streams", str(streams), "--max-tokens", str(200_000 // streams)]
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(options.repeats):
            for side in ("off", "on"):
                runs[side].append(bench_once(["--target", f"127.0.0.1:{stacks[side].port}", *common]))
        off, on = ({key: middle([run[key] for run in runs[side]]) for key in runs[side][0]} for side in ("off", "on"))
        result["throughput"] = {"streams": streams, "off": off, "on": on, "runs": runs,
                                "tokens_per_s_ratio": on["tokens_per_s"] / off["tokens_per_s"]}
        print(f"{streams} streams: off {off['tokens_per_s']:8.0f} tok/s, on {on['tokens_per_s']:8.0f} tok/s, "
              f"ratio {result['throughput']['tokens_per_s_ratio']:.3f}", flush=True)
        trips = {side: [] for side in ("off", "on")}
        for _ in range(5):  # alternated in slices, so drift on a shared machine hits both alike
            for side in ("off", "on"):
                trips[side] += round_trips(f"127.0.0.1:{stacks[side].port}", options.round_trips // 5)
        result["round_trip"] = {
            **{f"{side}_ms_{q}": percentile(trips[side], q) for side in ("off", "on") for q in (50, 99)},
            "added_ms_p50": percentile(trips["on"], 50) - percentile(trips["off"], 50),
            "requests": options.round_trips,
        }
        print(f"one-token round trip p50: off {result['round_trip']['off_ms_50']:.2f} ms, on "
              f"{result['round_trip']['on_ms_50']:.2f} ms", flush=True)
    finally:
        for stack in stacks.values():
            stack.stop()  # the sidecar and the worker export what they still hold as they exit
        spans, exports = receiver.communicate("", timeout=60)[0].split()
    result["receiver"] = {"spans": int(spans), "exports": int(exports)}
    print(f"the receiver got {spans} spans in {exports} exports")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tracing.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "tracing.png")
    print(f"wrote {RESULTS / 'tracing.json'} and tracing.png")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, rtt) = plt.subplots(1, 2, figsize=(10, 4))
    t = result["throughput"]
    tput.bar(["tracing off", "tracing on (ratio 1.0)"], [t["off"]["tokens_per_s"], t["on"]["tokens_per_s"]],
             color=["#888", "#3a7"])
    tput.set_ylabel("tokens/s")
    tput.set_title(f"{t['streams']} streams through the sidecar: on / off = {t['tokens_per_s_ratio']:.3f}")
    r = result["round_trip"]
    for offset, q in ((-0.2, 50), (0.2, 99)):
        rtt.bar([offset, 1 + offset], [r[f"off_ms_{q}"], r[f"on_ms_{q}"]], 0.38, label=f"p{q}")
    rtt.set_xticks([0, 1], ["tracing off", "tracing on"])
    rtt.set_ylabel("ms")
    rtt.set_title("one-token request, round trip")
    rtt.legend()
    fig.suptitle(f"{result['machine']['cpu']}, {result['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

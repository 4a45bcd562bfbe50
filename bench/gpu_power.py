"""What the GPU's power limit does to the benches' ceilings and steps.

gpu_roofline.matmul_peak and copy_bandwidth take the best of bursts of a few ms, run at the boost
clock. A step that keeps the tensor cores and the HBM busy for seconds holds the board at its power
limit, and the board lowers the SM clock to stay under it, by how much depending on the bits it
moves: on an H200 (700 W), the Llama-8B shape's decode step at batch 256 over a KV cache of zeros
ran at 1,980 MHz and 8.32 ms, over one of random bf16 at 1,500-1,530 MHz and 9.45 ms, both at
683-688 W; nvidia-smi gives the software power cap as the reason for such a step's lower clock
(at 57-58 C: not heat). So the benches record the clock, the power and those reasons while they
run (GpuSampler), and `held_rates` measures both ceilings as the board holds them: each run back to
back for seconds on random data, the rate over the last third.
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from typing import Self

import torch

LIMITS = ("power.limit", "clocks.max.sm", "clocks.sm", "memory.total", "driver_version")


def limits() -> dict:
    """The first GPU's power limit, clocks (the SM's at the query: idle) and memory as nvidia-smi
    reports them, for the benches' machine record; {} where it does not run. Boards of one name
    differ: an H200 comes at 700 W, or 600 W as H200 NVL."""
    try:
        out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={','.join(LIMITS)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {f"gpu_{key.replace('.', '_')}": value.strip() for key, value in zip(LIMITS, out.split(","))}


SLOWDOWNS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
             0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
             0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
"""nvidia-smi's clocks_throttle_reasons bits (NVML's nvmlClocksEventReason*): why the clock is below
its most. Drivers from 535 name the field clocks_event_reasons and still take the old name (580 does),
which drivers before them know alone."""


class GpuSampler:
    """nvidia-smi's SM clock, power draw, temperature and the reasons for a lowered clock, of the
    first GPU every `period_ms` while entered, from a process of its own (ended on exit); no samples
    where nvidia-smi does not run."""

    QUERY = ("nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
             "--format=csv,noheader,nounits")

    def __init__(self, period_ms: int = 100):
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, float, float, int]] = []  # (perf_counter, MHz, W, C, reason bits)
        self.process: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None

    def __enter__(self) -> Self:
        try:
            self.process = subprocess.Popen([*self.QUERY, "-lms", str(self.period_ms)], stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                clock, power, temperature, reasons = (field.strip() for field in line.split(","))
                sample = (time.perf_counter(), float(clock), float(power), float(temperature), int(reasons, 16))
            except ValueError:  # "[N/A]", or a line of an error
                continue
            self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(timeout=10)

    def summary(self, since: float = 0.0) -> dict:
        """The samples taken after perf_counter() `since`: median and least SM clock (MHz), median
        power (W) and temperature (C), and every reason a sample gave for a lowered clock; {} where
        there are none."""
        kept = [sample[1:] for sample in self.samples if sample[0] >= since]
        if not kept:
            return {}
        clocks = [clock for clock, *_ in kept]
        seen = 0
        for *_, reasons in kept:
            seen |= reasons
        return {"sm_clock_mhz": statistics.median(clocks), "sm_clock_mhz_least": min(clocks),
                "power_w": statistics.median(power for _, power, _, _ in kept),
                "temperature_c": statistics.median(temperature for _, _, temperature, _ in kept),
                "slowdowns": [name for bit, name in SLOWDOWNS.items() if seen & bit], "samples": len(kept)}


def clock(summary: dict) -> str:
    """', 1,530 MHz 691 W sw_power_cap': a GpuSampler summary for a line of output ('' where nothing was
    sampled), with the reasons for a lowered clock other than an idle GPU."""
    if not summary:
        return ""
    reasons = [name for name in summary["slowdowns"] if name != "gpu_idle"]
    return f", {summary['sm_clock_mhz']:,.0f} MHz {summary['power_w']:.0f} W" + "".join(f" {name}" for name in reasons)


def held_rates(seconds: float = 3.0) -> dict:
    """The bf16 matmul rate (8192^3, random operands) and the copy bandwidth (4 GiB of random
    bytes, read + written) as the board holds them: each run back to back for `seconds`, timed by
    events, and the rate over the runs that end in the last third, with GpuSampler's summary of it."""
    n, size = 8192, 1 << 32
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    src = torch.randint(-32768, 32767, (size // 2,), device="cuda", dtype=torch.int16)
    dst = torch.empty_like(src)
    matmul = _held(lambda: a @ b, seconds)
    copy = _held(lambda: dst.copy_(src), seconds)
    return {"matmul_flops": 2 * n ** 3 / matmul.pop("seconds"), "matmul_gpu": matmul,
            "copy_bytes_per_s": 2 * size / copy.pop("seconds"), "copy_gpu": copy}


def _held(work, seconds: float) -> dict:
    """`work` back to back for `seconds`: the mean seconds a run of those ending in the last third,
    and GpuSampler's summary of that third."""
    work()
    torch.cuda.synchronize()
    ends: list[tuple[float, torch.cuda.Event]] = []  # (host time at launch, event after the run)
    with GpuSampler() as gpu:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            work()
            ends.append((time.perf_counter(), torch.cuda.Event(enable_timing=True)))
            ends[-1][1].record()
            if len(ends) % 8 == 0:
                ends[-8][1].synchronize()  # the host no more than 8 runs ahead: launch times follow the device's
        torch.cuda.synchronize()
    tail = [event for at, event in ends if at >= started + seconds * 2 / 3]
    if len(tail) < 2:
        tail = [event for _, event in ends[-2:]]
    return {"seconds": tail[0].elapsed_time(tail[-1]) / 1000 / (len(tail) - 1),
            **gpu.summary(since=started + seconds * 2 / 3)}

"""What the benches' JSON records of the GPU (bench/gpu_power.py): nvidia-smi's power limit and
clocks, and its samples of the clock, power and reasons for a lowered clock through a run, where it
runs; nothing where it does not."""

import os
import stat

from bench import gpu_power


def fake_smi(folder, script: str) -> None:
    path = folder / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_gpus_limits_are_read_from_nvidia_smi(tmp_path, monkeypatch):
    fake_smi(tmp_path, 'echo "700.00 W, 1980 MHz, 345 MHz, 143771 MiB, 580.159.04"')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu_power.limits() == {
        "gpu_power_limit": "700.00 W", "gpu_clocks_max_sm": "1980 MHz", "gpu_clocks_sm": "345 MHz",
        "gpu_memory_total": "143771 MiB", "gpu_driver_version": "580.159.04"}


def test_no_nvidia_smi_or_a_failing_one_records_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_power.limits() == {}
    fake_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    assert gpu_power.limits() == {}


def test_the_sampler_keeps_nvidia_smis_clock_power_and_slowdown_lines(tmp_path, monkeypatch):
    # The fake prints its samples and exits: the sampler reads its pipe to the end on exit.
    fake_smi(tmp_path, '[ "$5 $6" = "-lms 100" ] || exit 3\n'
                       'printf "1980, 683.14, 45, 0x0000000000000001\\n1500, 690.00, 60, 0x0000000000000004\\n'
                       '[N/A], [N/A], [N/A], [N/A]\\n1650, 700.00, 62, 0x0000000000000024\\n"')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with gpu_power.GpuSampler() as gpu:
        gpu.process.wait()
    assert gpu.summary() == {"sm_clock_mhz": 1650, "sm_clock_mhz_least": 1500, "power_w": 690.0, "temperature_c": 60,
                             "slowdowns": ["gpu_idle", "sw_power_cap", "sw_thermal_slowdown"], "samples": 3}
    assert gpu_power.clock(gpu.summary()) == ", 1,650 MHz 690 W sw_power_cap sw_thermal_slowdown"  # idle left out
    assert gpu.summary(since=gpu.samples[-1][0]) == {
        "sm_clock_mhz": 1650, "sm_clock_mhz_least": 1650, "power_w": 700.0, "temperature_c": 62,
        "slowdowns": ["sw_power_cap", "sw_thermal_slowdown"], "samples": 1}


def test_the_sampler_has_nothing_without_nvidia_smi_or_with_a_failing_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with gpu_power.GpuSampler() as gpu:
        pass
    assert gpu.summary() == {} and gpu_power.clock(gpu.summary()) == ""
    fake_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    with gpu_power.GpuSampler() as gpu:
        gpu.process.wait()
    assert gpu.summary() == {}

"""What the benches' JSON records of the GPU (bench/structured.py): nvidia-smi's power limit and
clocks where it runs, nothing where it does not."""

import os
import stat

from bench import structured


def fake_smi(folder, script: str) -> None:
    path = folder / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_gpus_limits_are_read_from_nvidia_smi(tmp_path, monkeypatch):
    fake_smi(tmp_path, 'echo "700.00 W, 1980 MHz, 345 MHz, 143771 MiB, 580.159.04"')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert structured.gpu_limits() == {
        "gpu_power_limit": "700.00 W", "gpu_clocks_max_sm": "1980 MHz", "gpu_clocks_sm": "345 MHz",
        "gpu_memory_total": "143771 MiB", "gpu_driver_version": "580.159.04"}


def test_no_nvidia_smi_or_a_failing_one_records_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert structured.gpu_limits() == {}
    fake_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    assert structured.gpu_limits() == {}

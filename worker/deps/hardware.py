"""What this machine is: NVIDIA GPUs through NVML, AMD and Ascend through their vendors' tools, CPU flags."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class HardwareProfile:
    """Facts read off the machine; the registry matches them to a profile name."""

    vendor: str
    """nvidia | amd | ascend | cpu: the accelerator the engines would use."""
    arch: str
    cpu_flags: frozenset[str] = frozenset()
    gpus: tuple[GPU, ...] = ()
    driver: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def min_compute_capability(self) -> tuple[int, int] | None:
        """Mixed GPUs run what the oldest of them supports."""
        capabilities = [g.compute_capability for g in self.gpus if g.compute_capability]
        return min(capabilities) if capabilities else None


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvidia_gpus(nvml: Any) -> tuple[tuple[GPU, ...], str | None]:
    """GPUs and driver version through an NVML binding (pynvml's API); none when NVML is absent."""
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no library: not an NVIDIA host
        return (), None
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(GPU(index, _decode(nvml.nvmlDeviceGetName(handle)),
                            int(nvml.nvmlDeviceGetMemoryInfo(handle).total), (int(major), int(minor))))
        return tuple(gpus), _decode(nvml.nvmlSystemGetDriverVersion())
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def amd_gpus(run: Callable[..., subprocess.CompletedProcess]) -> tuple[GPU, ...]:
    """AMD GPUs from `rocm-smi --showproductname --showmeminfo vram --json`."""
    if shutil.which("rocm-smi") is None:
        return ()
    result = run(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"],
                 capture_output=True, text=True, timeout=20)
    if result.returncode != 0:
        return ()
    cards = json.loads(result.stdout or "{}")
    return tuple(
        GPU(index, info.get("Card Series") or info.get("Card series") or name,
            int(info.get("VRAM Total Memory (B)", 0)))
        for index, (name, info) in enumerate(sorted(cards.items())) if name.startswith("card"))


def ascend_npus(run: Callable[..., subprocess.CompletedProcess]) -> tuple[GPU, ...]:
    """Ascend NPUs from `npu-smi info -l` (one "NPU ID" block per device)."""
    if shutil.which("npu-smi") is None:
        return ()
    result = run(["npu-smi", "info", "-l"], capture_output=True, text=True, timeout=20)
    if result.returncode != 0:
        return ()
    npus, current = [], {}
    for line in result.stdout.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "NPU ID" and current:
            npus.append(current)
            current = {}
        current[key] = value
    if current:
        npus.append(current)
    return tuple(GPU(i, npu.get("Product Name") or npu.get("Chip Name", "Ascend"), 0) for i, npu in enumerate(npus))


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def this_cpu(cpuinfo: str | None = None, machine: str | None = None) -> tuple[str, frozenset[str]]:
    """(architecture, flags) of the CPU this runs on, or of a recorded /proc/cpuinfo and machine."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(machine or platform.machine(), machine or platform.machine())
    return arch, cpu_flags(cpuinfo)


def detect_hardware(
    nvml: Any | None = None,
    cpuinfo: str | None = None,
    machine: str | None = None,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> HardwareProfile:
    """Reads the machine; each source can be replaced by a recorded answer (tests, other hosts)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            nvml = None
    arch, flags = this_cpu(cpuinfo, machine)
    gpus, driver = nvidia_gpus(nvml) if nvml is not None else ((), None)
    if gpus:
        names = {g.name for g in gpus}
        notes = (f"mixed GPUs ({', '.join(sorted(names))}): matched by the oldest",) if len(
            {g.compute_capability for g in gpus}) > 1 else ()
        return HardwareProfile("nvidia", arch, flags, gpus, driver, notes)
    if amd := amd_gpus(run):
        return HardwareProfile("amd", arch, flags, amd)
    if npus := ascend_npus(run):
        return HardwareProfile("ascend", arch, flags, npus)
    return HardwareProfile("cpu", arch, flags)


# The instruction sets the CPU kernels are built for (engine.cpu_isa), best first: the architecture
# each runs on and the CPU flags it needs (x86-64-v4 and -v3's vector parts; NEON is armv8's).
CPU_ISAS = {
    "avx512": ("x86_64", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})),
    "avx2": ("x86_64", frozenset({"avx2", "fma", "f16c", "bmi2"})),
    "neon": ("aarch64", frozenset({"asimd"})),
    "default": (None, frozenset()),
}


def runnable_isas(arch: str, flags: frozenset[str]) -> list[str]:
    """engine.cpu_isa values this CPU runs, best first ("default": plain C++, any CPU)."""
    return [isa for isa, (needs_arch, needs) in CPU_ISAS.items() if needs_arch in (None, arch) and needs <= flags]


def flags_within(isa: str, arch: str, flags: frozenset[str]) -> frozenset[str]:
    """The CPU's flags as a CPU whose best is `isa` would have them (engine.cpu_isa below the best:
    the registry's profile, and so the preset, is the one for what runs): AVX-512 and AMX dropped
    for avx2, every vector extension for default."""
    runnable = runnable_isas(arch, flags)
    if isa not in runnable or isa == runnable[0]:
        return flags
    if isa == "avx2":
        return frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    return frozenset(f for f in flags if not f.startswith(("avx", "amx", "fma", "f16c", "asimd", "sve")))


def isa_environment(isa: str, arch: str, flags: frozenset[str]) -> dict[str, str]:
    """What oneDNN (the linear layers), ATen (torch's own CPU kernels) and MKL (torch's fp32 GEMMs,
    which vLLM's CPU linears call) read from the environment, once, before their first op, to keep
    below this CPU's best ISA: empty for auto and the best."""
    runnable = runnable_isas(arch, flags)
    if isa == "auto" or isa not in runnable or isa == runnable[0]:
        return {}
    return {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
            "default": {"ONEDNN_MAX_CPU_ISA": "SSE41", "ATEN_CPU_CAPABILITY": "default",
                        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}.get(isa, {})

"""`cy-llm doctor`: the installed environment against the lock file and the detected hardware."""

from __future__ import annotations

import importlib.metadata
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from packaging.requirements import InvalidRequirement, Requirement

from worker.deps.hardware import HardwareProfile


@dataclass(frozen=True)
class Lock:
    """A requirements.lock written by `cy-llm setup`: pins plus a header of `# key: value` lines."""

    requirements: tuple[str, ...]
    header: dict[str, str]

    @property
    def remove_after_install(self) -> tuple[str, ...]:
        return tuple(self.header.get("remove-after-install", "").split())

    @classmethod
    def read(cls, path: str | Path) -> Lock:
        requirements, header = [], {}
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line.startswith("#"):
                key, sep, value = line.lstrip("# ").partition(": ")
                if sep:
                    header[key.strip()] = value.strip()
            elif line:
                requirements.append(line)
        return cls(tuple(requirements), header)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_facts() -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    return {"version": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "cuda_available": torch.cuda.is_available()}


def verify_environment(
    lock: Lock | None,
    hardware: HardwareProfile,
    socket_path: str,
    installed: Callable[[str], str | None] = installed_version,
    torch_probe: Callable[[], dict[str, Any] | None] = torch_facts,
) -> list[Check]:
    """Every check with its verdict; any failing one makes doctor exit non-zero."""
    checks = []
    if lock is None:
        checks.append(Check("lock file", False, "no requirements.lock: run `cy-llm setup` (or pass --lock)"))
    else:
        for line in lock.requirements:
            try:
                requirement = Requirement(line)
            except InvalidRequirement as exc:
                checks.append(Check(line, False, f"unreadable requirement: {exc}"))
                continue
            version = installed(requirement.name)
            if version is None:
                checks.append(Check(requirement.name, False, f"missing (lock wants {requirement.specifier})"))
            elif not requirement.specifier.contains(version, prereleases=True):
                checks.append(Check(requirement.name, False, f"{version} installed, lock wants {requirement.specifier}"))
            else:
                checks.append(Check(requirement.name, True, version))
        for name in lock.remove_after_install:
            version = installed(name)
            checks.append(Check(name, version is None, "absent, as it should be" if version is None else
                                f"{version} installed: it breaks imports beside this stack; pip uninstall {name}"))
    checks.append(_torch_check(hardware, torch_probe()))
    if hardware.vendor == "nvidia":
        checks.append(Check("NVML", True, f"driver {hardware.driver}, {len(hardware.gpus)} GPU(s)"))
    elif installed("nvidia-ml-py") is not None:
        checks.append(Check("NVML", True, "not reachable: no NVIDIA driver here, which this hardware needs none of"))
    checks.append(_socket_check(socket_path))
    return checks


def _torch_check(hardware: HardwareProfile, facts: dict[str, Any] | None) -> Check:
    if facts is None:
        return Check("torch", False, "not installed; the model engines need it")
    build = "CUDA " + facts["cuda"] if facts["cuda"] else "ROCm " + facts["hip"] if facts["hip"] else "CPU"
    detail = f"{facts['version']} ({build} build)"
    if hardware.vendor == "nvidia":
        ok = bool(facts["cuda"]) and facts["cuda_available"]
        return Check("torch device", ok, detail + ("" if ok else ": this host has NVIDIA GPUs; install a CUDA build"))
    if hardware.vendor == "amd":
        ok = bool(facts["hip"]) and facts["cuda_available"]
        return Check("torch device", ok, detail + ("" if ok else ": this host has AMD GPUs; install a ROCm build"))
    if hardware.vendor == "cpu" and facts["cuda"]:
        return Check("torch device", False, detail + ": a CUDA build on a host without NVIDIA GPUs "
                                                       "(GBs of unused libraries); install the CPU build")
    return Check("torch device", True, detail)


def _socket_check(socket_path: str) -> Check:
    directory = Path(socket_path).parent
    if not directory.exists():
        parent = next((p for p in directory.parents if p.exists()), Path("/"))
        ok = os.access(parent, os.W_OK)
        return Check("socket directory", ok, f"{directory} will be created 0750" if ok else
                     f"{directory} does not exist and {parent} is not writable")
    mode = stat.S_IMODE(directory.stat().st_mode)
    if not os.access(directory, os.W_OK):
        return Check("socket directory", False, f"{directory} is not writable by this user")
    if mode & 0o007:
        return Check("socket directory", False, f"{directory} is {oct(mode)}: others can reach the socket; chmod 0750")
    return Check("socket directory", True, f"{directory} {oct(mode)}")

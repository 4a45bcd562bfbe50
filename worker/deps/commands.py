"""The `cy-llm setup` and `cy-llm doctor` commands: tables for people, exit codes for scripts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping

from worker.config import Config
from worker.deps.environment import Lock, verify_environment
from worker.deps.hardware import HardwareProfile, detect_hardware
from worker.deps.install import install, write_lock
from worker.deps.registry import WORKER_ENGINES, Registry, RegistryError

GIB = 1 << 30


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def describe(hardware: HardwareProfile, profile: str) -> str:
    rows = [("profile", profile), ("vendor", hardware.vendor), ("arch", hardware.arch)]
    simd = sorted(f for f in hardware.cpu_flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve"})
    rows.append(("cpu flags", " ".join(simd) or "-"))
    for gpu in hardware.gpus:
        capability = ".".join(map(str, gpu.compute_capability)) if gpu.compute_capability else "-"
        rows.append((f"gpu {gpu.index}", f"{gpu.name}, {gpu.memory_bytes / GIB:.0f} GiB, compute {capability}"))
    if hardware.driver:
        rows.append(("driver", hardware.driver))
    rows.extend(("note", note) for note in hardware.notes)
    return table(rows, ("detected", ""))


def setup(engine: str | None, hardware_choice: str, registry_path: str | None, lock_path: str,
          dry_run: bool, yes: bool, env: Mapping[str, str]) -> int:
    try:
        registry = Registry.load(registry_path)
        detected = detect_hardware()
        profile = registry.pick_profile(hardware_choice, detected)
        print("[1/4] hardware\n" + describe(detected, profile) + "\n")
        rows = []
        for name in WORKER_ENGINES:
            try:
                packages = registry.resolve(profile, name).requirements
                rows.append((name, "yes", ", ".join(packages)))
            except RegistryError:
                rows.append((name, "no", registry.refusal(profile, name) or "not in the registry"))
        print(table(rows, ("engine", "runs", "packages, or why not")) + "\n")
        engine = engine or registry.default_engine(profile)
        requirements = registry.resolve(profile, engine)
    except RegistryError as exc:
        print(f"cy-llm setup: {exc}", file=sys.stderr)
        return 2
    lock = write_lock(lock_path, requirements, registry)
    print(f"[2/4] resolved {engine} on {profile}: wrote {lock} ({len(requirements.requirements)} pins)")
    if requirements.notes:
        print(f"      {requirements.notes}")
    if not dry_run and not yes:
        if not sys.stdin.isatty():
            print("cy-llm setup: not a terminal; pass --yes to install", file=sys.stderr)
            return 2
        if input(f"install {len(requirements.requirements)} pinned packages into {sys.prefix}? [y/N] ").lower() != "y":
            return 1
    print(f"[3/4] {'resolving (dry run)' if dry_run else 'installing'} with pip", flush=True)
    code = install(lock, requirements, env, dry_run)
    if code != 0 or dry_run:
        print("[4/4] " + ("dry run done; nothing installed" if code == 0 else f"pip failed ({code})"))
        return code
    print("[4/4] checking the environment")
    return report(verify_environment(Lock.read(lock), detected, "/tmp/cy-llm-setup-check/w.sock"))


def doctor(lock_path: str, registry_path: str | None, config: Config) -> int:
    detected = detect_hardware()
    try:
        profile = Registry.load(registry_path).match(detected)
    except RegistryError as exc:
        profile = f"unknown ({exc})"
    print(describe(detected, profile) + "\n")
    lock = Lock.read(lock_path) if Path(lock_path).is_file() else None
    if lock is not None:
        print(f"lock {lock_path}: {lock.header.get('engine', '?')} on {lock.header.get('hardware', '?')}")
        if lock.header.get("hardware") not in (None, profile):
            print(f"  note: the lock was made for {lock.header['hardware']}, this machine is {profile}")
    return report(verify_environment(lock, detected, config.server.socket))


def report(checks) -> int:
    print(table([("ok" if c.ok else "FAIL", c.name, c.detail) for c in checks], ("", "check", "detail")))
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"\n{len(failed)} problem(s): " + "; ".join(f"{c.name}: {c.detail}" for c in failed), file=sys.stderr)
        return 1
    print("\nall checks passed")
    return 0

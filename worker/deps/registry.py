"""The dependency registry: validated on load, matched to detected hardware, resolved to pinned sets."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from worker.deps.hardware import HardwareProfile

# The checkout's deploy/ folder; an installed wheel carries a copy inside this package (setup.py).
_CHECKOUT_REGISTRY = Path(__file__).resolve().parents[2] / "deploy" / "dependency_registry.json"
DEFAULT_REGISTRY = (_CHECKOUT_REGISTRY if _CHECKOUT_REGISTRY.is_file()
                    else Path(__file__).resolve().with_name("dependency_registry.json"))
# The schema this code understands, whichever registry file is loaded.
SCHEMA = DEFAULT_REGISTRY.with_name("dependency_registry.schema.json")
WORKER_ENGINES = ("transformers", "native", "vllm", "trtllm")


class RegistryError(ValueError):
    """A registry file is invalid, or a (hardware, engine) pair cannot be resolved."""


@dataclass(frozen=True)
class RequirementSet:
    hardware: str
    engine: str
    requirements: tuple[str, ...]
    extra_index_urls: tuple[str, ...] = ()
    remove_after_install: tuple[str, ...] = ()
    notes: str = ""


@dataclass(frozen=True)
class Preset:
    hardware: str
    engine: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str
    block_size: int
    gpu_memory_utilization: float | None = None
    quantization: str | None = None
    dtype: str | None = None  # engine.dtype where the config sets none (CPU: what measured fastest)


class Registry:
    def __init__(self, data: dict[str, Any], source: str = "<memory>"):
        self.data = data
        self.source = source
        self.digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def load(cls, path: str | Path | None = None) -> Registry:
        path = Path(path) if path else DEFAULT_REGISTRY
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise RegistryError(f"no registry at {path}; pass --registry FILE") from None
        except json.JSONDecodeError as exc:
            raise RegistryError(f"{path}: not JSON: {exc}") from None
        schema = json.loads(SCHEMA.read_text())
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(data), key=lambda e: list(e.absolute_path))
        if errors:
            error = errors[0]
            raise RegistryError(f"{path}: at {_json_path(error.absolute_path)}: {error.message}")
        registry = cls(data, str(path))
        registry._check_references(path)
        return registry

    def _check_references(self, path: Path) -> None:
        """What the schema cannot say: names used in the matrix exist, and no pair is given twice."""
        profiles = set(self.data["hardware"])
        seen: dict[tuple[str, str], str] = {}
        for section in ("matrix", "refused", "presets"):
            for index, entry in enumerate(self.data[section]):
                for position, name in enumerate(entry["hardware"]):
                    if name not in profiles:
                        raise RegistryError(f"{path}: at $.{section}[{index}].hardware[{position}]: "
                                            f"unknown hardware profile {name!r}")
                    if section != "presets":
                        key = (name, entry["engine"])
                        if key in seen:
                            raise RegistryError(f"{path}: at $.{section}[{index}]: ({name}, {entry['engine']}) "
                                                f"is also given at {seen[key]}")
                        seen[key] = f"$.{section}[{index}]"
                for position, package in enumerate(entry.get("packages", ())):
                    if package not in self.data["engines"]:
                        raise RegistryError(f"{path}: at $.{section}[{index}].packages[{position}]: "
                                            f"unknown engine package {package!r}")

    @property
    def profiles(self) -> list[str]:
        return list(self.data["hardware"])

    def match(self, hardware: HardwareProfile) -> str:
        """The first profile (in registry order) that fits the detected facts."""
        for name, profile in self.data["hardware"].items():
            if profile["vendor"] != hardware.vendor:
                continue
            if "arch" in profile and profile["arch"] != hardware.arch:
                continue
            if not set(profile.get("cpu_flags", ())) <= hardware.cpu_flags:
                continue
            if "compute_capability" in profile:
                capability = hardware.min_compute_capability
                low, high = (_capability(profile["compute_capability"][k]) for k in ("min", "max"))
                if capability is None or not low <= capability <= high:
                    continue
            return name
        raise RegistryError(f"no hardware profile fits {hardware.vendor}/{hardware.arch} "
                            f"(compute capability {hardware.min_compute_capability}); profiles: {', '.join(self.profiles)}")

    def pick_profile(self, requested: str, detected: HardwareProfile) -> str:
        """--hardware: auto, a profile name, or a vendor (cpu, nvidia, ...) narrowed by what is detected."""
        if requested == "auto":
            return self.match(detected)
        if requested in self.data["hardware"]:
            return requested
        vendor_profiles = [n for n, p in self.data["hardware"].items() if p["vendor"] == requested]
        if not vendor_profiles:
            raise RegistryError(f"unknown hardware {requested!r}; use auto, a vendor "
                                f"({', '.join(sorted({p['vendor'] for p in self.data['hardware'].values()}))}) "
                                f"or a profile ({', '.join(self.profiles)})")
        if detected.vendor == requested:
            return self.match(detected)
        if requested == "cpu":
            return self.match(dataclasses.replace(detected, vendor="cpu", gpus=()))
        return vendor_profiles[0]

    def default_engine(self, profile: str) -> str:
        return self.data["hardware"][profile].get("default_engine", "transformers")

    def resolve(self, profile: str, engine: str) -> RequirementSet:
        """The pinned set for (profile, engine), or a RegistryError saying why not and what is valid."""
        if profile not in self.data["hardware"]:
            raise RegistryError(f"unknown hardware profile {profile!r}; known: {', '.join(self.profiles)}")
        for entry in self.data["matrix"]:
            if profile in entry["hardware"] and entry["engine"] == engine:
                return RequirementSet(profile, engine, tuple(entry["requirements"]),
                                      tuple(entry.get("extra_index_urls", ())),
                                      tuple(entry.get("remove_after_install", ())), entry.get("notes", ""))
        valid_engines = [e for e in WORKER_ENGINES if self._entry("matrix", profile, e)]
        valid_hardware = [p for p in self.profiles if self._entry("matrix", p, engine)]
        refusal = self._entry("refused", profile, engine)
        why = refusal["reason"] if refusal else f"the registry has no entry for ({profile}, {engine})"
        raise RegistryError(
            f"cannot install engine {engine!r} on {profile}: {why}\n"
            f"  engines for {profile}: {', '.join(valid_engines) or 'none'}\n"
            f"  hardware for {engine}: {', '.join(valid_hardware) or 'none'}")

    def refusal(self, profile: str, engine: str) -> str | None:
        entry = self._entry("refused", profile, engine)
        return entry["reason"] if entry else None

    def preset(self, profile: str, engine: str) -> Preset | None:
        entry = self._entry("presets", profile, engine)
        if entry is None:
            return None
        fields = {k: v for k, v in entry.items() if k not in ("hardware", "engine")}
        return Preset(hardware=profile, engine=engine, **fields)

    def _entry(self, section: str, profile: str, engine: str) -> dict[str, Any] | None:
        return next((e for e in self.data[section] if profile in e["hardware"] and e["engine"] == engine), None)


def _capability(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def _json_path(parts) -> str:
    path = "$"
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def apply_preset(config: Any, preset: Preset, engine_args: tuple[str, ...]) -> tuple[Any, dict[str, Any]]:
    """The config with the preset's values where the user set none: max_num_seqs becomes the
    concurrency limit, dtype engine.dtype, and the keys the engine takes (`engine_args`) become
    engine arguments; max_num_seqs grows to hold tenants.burst_slots above the limit."""
    applied: dict[str, Any] = {}
    resources, engine = config.resources, config.engine
    if "resources.max_concurrency" not in config.explicit_keys:
        resources = dataclasses.replace(resources, max_concurrency=preset.max_num_seqs)
        applied["resources.max_concurrency"] = preset.max_num_seqs
    if preset.dtype is not None and "engine.dtype" not in config.explicit_keys:
        engine = dataclasses.replace(engine, dtype=preset.dtype)
        applied["engine.dtype"] = preset.dtype
    args = dict(engine.args)
    for key in engine_args:
        value = getattr(preset, key)
        if value is not None and f"engine.args.{key}" not in config.explicit_keys:
            args[key] = value
            applied[f"engine.args.{key}"] = value
    burst = config.tenants.burst_slots
    if burst and "max_num_seqs" in engine_args and "engine.args.max_num_seqs" not in config.explicit_keys:
        # Burst slots run above the concurrency limit: the engine batches them too.
        args["max_num_seqs"] = applied["engine.args.max_num_seqs"] = max(
            args.get("max_num_seqs") or 0, resources.max_concurrency + burst)
    engine = dataclasses.replace(engine, args=args)
    return dataclasses.replace(config, resources=resources, engine=engine), applied

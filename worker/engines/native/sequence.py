"""What the engine thread keeps of a request (Sequence) and of a step it has launched (Step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from worker.engines.base import RequestStream
from worker.engines.detokenizer import OutputText
from worker.engines.logprobs import Pending, of_prompt
from worker.engines.native.block_manager import BlockTable
from worker.engines.native.batch import Batch
from worker.engines.native.pacer import Work
from worker.engines.native.speculation import Proposer
from worker.engines.sampler import Draws, Rows, choose, on_device
from worker.request import GenerationRequest, TokenLogprob
from worker.telemetry import get_logger

log = get_logger(__name__)


@dataclass
class Outbox:
    """A sequence's tokens read since its last message, and what of them is text already: a
    sequence with stop strings reads each step's tokens at once, others when the message goes."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    read: int = 0
    """How many of `ids` are in `text`."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sent_at: float = 0.0
    """Monotonic time of the sequence's last message; 0 before the first."""


@dataclass(eq=False)
class Sequence:
    stream: RequestStream
    request: GenerationRequest
    generator: Draws | None
    """None for a greedy request (sampler.make_generator)."""
    text: OutputText
    tokens: list[int]
    """Prompt then generated tokens: what the cache must hold (recomputed after a preemption)."""
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    blocks: BlockTable = field(default_factory=BlockTable)
    done: bool = False
    """Its blocks are given back: finished or aborted. A step launched before that ignores its row."""
    aborted: bool = False
    matcher: Any = None
    """The grammar's matcher (xgrammar), advanced with each sampled token; None when unconstrained."""
    logprob: TokenLogprob | None = None
    """Of the token sampled last, until it is emitted."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """Filled chunk by chunk during the prefill when the request asked; sent with the first token."""
    proposer: Proposer | None = None
    """Its speculative proposals (speculation.py); None when it does not speculate."""
    draft: list[int] = field(default_factory=list)
    """Tokens proposed after its last one in the step being run, checked when the step is read."""
    outbox: Outbox = field(default_factory=Outbox)
    """Its tokens read since its last message (messages.py paces them)."""
    end: int = 1 << 62
    """How many tokens it has when max_tokens or the model's context ends it."""
    stop_ids: frozenset[int] = frozenset()
    """Tokens that end it: its stop ids, and EOS unless it ignores EOS."""

    def __post_init__(self) -> None:
        if self.request.prompt_logprobs is not None:
            self.prompt_logprobs = [TokenLogprob(self.tokens[0], None)]

    @property
    def scores_prompt(self) -> bool:
        """Still needs logits of prompt positions (so it cannot start from cached blocks)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.request.prompt_token_ids)

    def append(self, token: int) -> None:
        """A sampled token: the cache's to hold from the next step on, the grammar's to follow now."""
        self.tokens.append(token)
        self.output_ids.append(token)
        if self.matcher is not None and not self.matcher.accept_token(token):
            log.error("grammar refused a token its mask allowed", request_id=self.request.request_id, token=token)

    def at_limit(self) -> bool:
        """Its tokens reached max_tokens or the model's context."""
        return len(self.tokens) >= self.end

    def ends_with_next(self) -> bool:
        """Whether the token a step just launched samples for it (none of its tokens still on the
        device) is its last by length."""
        return len(self.tokens) + 1 >= self.end

    def score_prompt(self, logits: torch.Tensor, count: int) -> None:
        """Prompt logprobs from the rows of a prefill chunk of `count` tokens after the cached ones:
        the row of position p predicts token p + 1. Rows scored before a preemption are skipped."""
        first = len(self.prompt_logprobs) - 1 - self.num_cached
        upto = min(count, len(self.request.prompt_token_ids) - 1 - self.num_cached)
        if upto > first:
            self.prompt_logprobs.extend(of_prompt(logits[first:upto], self.tokens[self.num_cached + first + 1:
                                                                                   self.num_cached + upto + 1],
                                                  self.request.prompt_logprobs))

    @property
    def plain(self) -> bool:
        """Its next token is chosen from the logits alone: no grammar, logprobs or penalties, which
        need its last token on the host first (the grammar's state, the output so far)."""
        return self.matcher is None and self.request.logprobs is None and not self.request.sampling.is_penalized


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
    work: Work = field(default_factory=Work)
    """Priced by the PrefillPacer when scheduled (none for a step launched ahead: decodes only)."""
    launched_at: float = 0.0
    logprobs: Pending | None = None
    """Of the `ready` rows whose requests asked, in order."""
    logits: torch.Tensor | None = None
    """The ready rows' logits, until sample() has queued their sampling."""
    rows: Rows | None = None
    """What sampling reads of the ready rows (gathered by sample(), or those of the step launched before)."""
    verifying: list[Sequence] = field(default_factory=list)
    """Rows with proposals, in order; not in `ready`."""
    drafts: list[list[int]] = field(default_factory=list)
    """Their proposals (Sequence.draft when launched)."""
    bases: list[int] = field(default_factory=list)
    """Their first row's position: what their num_cached must be when the step is read."""
    draft_logits: torch.Tensor | None = None
    """Their logits: 1 + len(draft) rows each, checked by speculation.verify when the step is read."""
    targets: torch.Tensor | None = None
    """The argmax of every draft logits row (where a greedy row checks), on the device and being
    copied to `host_targets`."""
    host_targets: torch.Tensor | None = None
    targets_copied: torch.cuda.Event | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences it runs: a check launched ahead has several runs of one (ahead.checks)."""
        return len({id(seq) for seq, _ in self.scheduled}) if self.verifying else len(self.scheduled)

    @property
    def prefilled(self) -> int:
        """Prompt tokens it computes: its rows of more than one token that check no proposals."""
        checking = {id(seq) for seq in self.verifying}
        return sum(count for seq, count in self.scheduled if count > 1 and id(seq) not in checking)

    @torch.inference_mode()  # penalties write into the logits, which the forward made inference tensors
    def sample(self, grammars: Any) -> Step:
        """Queues the ready rows' sampling, and the tokens' copy to the host; nothing waits."""
        if self.rows is None:
            self.rows = Rows(self.ready)
        self.tokens, self.logprobs = choose(self.logits, self.rows, grammars)
        self.logits = None
        self.host_tokens, self.copied = to_host(self.tokens)
        return self

    def check(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], bases: list[int]) -> None:
        """Rows of `seqs` that check `drafts` from positions `bases` (1 + len(draft) logits rows
        each): the greedy choice among them queued and its copy to the host; nothing waits."""
        self.verifying, self.drafts, self.bases, self.draft_logits = seqs, drafts, bases, logits
        if any(seq.request.sampling.is_greedy for seq in seqs):
            self.targets = logits.float().argmax(dim=-1)
            self.host_targets, self.targets_copied = to_host(self.targets)

    def standing(self) -> list[bool]:
        """For each checking row, whether it still stands: its sequence not ended, and its cache
        where the step assumed (not so for a check launched ahead of one that rejected a proposal)."""
        return [not seq.done and seq.num_cached == base for seq, base in zip(self.verifying, self.bases)]

    def chosen(self) -> list[int] | None:
        """`targets` on the host, once copied; None where not computed."""
        if self.targets_copied is not None:
            self.targets_copied.synchronize()
        return self.host_targets.tolist() if self.host_targets is not None else None


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that copies a device's step tokens to the host (to_host), one for the process."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`tensor` being copied to the host, and the event that says the copy is done (None on the CPU).
    The copy runs on a stream of its own once what computes `tensor` is done, so the step queued
    next on the device's stream starts without it: on an H200 a copy there and the gap before it
    held every step 3-7 us (a batch-1 step of the Llama-1B shape, 0.829 -> 0.822 and 0.833 -> 0.830
    ms in two calls, alternated in one process)."""
    if not tensor.is_cuda:
        return tensor, None
    side = copy_stream(tensor.device)
    side.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(side):
        host, copied = tensor.to("cpu", non_blocking=True), torch.cuda.Event()
        copied.record(side)
    tensor.record_stream(side)  # its memory goes to no other tensor before the copy has read it
    return host, copied


def pick(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows] without waiting for what computes `tensor` (sampler.on_device): a verify step's
    draft logits picked with a list index held the engine thread 32-44% of its time on an H100."""
    if not tensor.is_cuda:
        return tensor[rows]
    return tensor.index_select(0, on_device(rows, tensor.device, torch.long))


LONG_CHUNK = 32
"""A chunk of more tokens is indexed with numpy: a Python loop over an 8k-token prefill step's
positions, and a list-to-tensor copy each of ids, positions and slots, held the device idle for
~11 ms of a ~27 ms step (Llama-1B shape, H100)."""


@dataclass(frozen=True)
class DecodeRows:
    """Which rows of a step run as one-token decodes over their sequence's blocks, each token
    seeing the cache up to its own position (every K/V of a step is stored before any attention
    reads it): a decode, a row with proposals, and a prompt chunk whose tokens see at most
    `context` positions on average and whose (query, key) pairs number at most `pairs`. A step of
    such rows only runs in the CPU's one-call decoder and in the CUDA graphs (engine.py sets the
    bounds); the defaults keep every chunk a prefill."""

    context: float = 0.0
    pairs: float = float("inf")

    @classmethod
    def in_graphs(cls, weight_bytes: int, kv_bytes_per_token: int) -> DecodeRows:
        """CUDA graphs: a step that admits a short prompt stays in the graphs (eager, SmolLM2's 30
        layers took ~12 ms of launches from Python on an H100 host against ~1.3 ms a graph step:
        16-token requests beside 8 decodes made 1,010 tokens/s against 5,215). Each chunk token's
        row reads its context's K/V again: kept to the bytes of the weights the step reads anyway
        (at 1/16 of them, 60-250-token prompts went eager: 10-19 ms to the first token on an idle
        H100 against 1.5-3.7 ms in the graphs, SmolLM2 and Llama-1B shapes)."""
        return cls(context=float("inf"), pairs=weight_bytes / kv_bytes_per_token)

    @classmethod
    def in_one_call(cls, token_flops: float, pair_flops: float) -> DecodeRows:
        """CPU, one-call decoder: a step that admits a request stays in the one call (a
        layer-by-layer step cost 4 ms more with 8 prompt tokens beside 7 decodes: 27.3 ms against
        23.2, SmolLM2 bf16 on 2 cores). Past about 1/16 of a token's linear FLOPs in attention
        pairs the decode kernel, each row reading its context apart, loses to the prefill path's
        GEMMs (512 tokens: 542 ms against 489)."""
        return cls(context=token_flops / pair_flops / 16)

    def __call__(self, seq: Sequence, count: int) -> bool:
        if count == 1 or seq.draft:
            return True
        mean = seq.num_cached + (count + 1) / 2
        return mean <= self.context and count * mean <= self.pairs


def kept_rows(seq: Sequence, count: int) -> int:
    """Logit rows a step keeps of `count` tokens of `seq`: every one for a sequence scoring its
    prompt or checking proposals, the last for others."""
    return count if seq.scores_prompt or seq.draft else 1


def logit_rows(scheduled: list[tuple[Sequence, int]]) -> list[int]:
    """Of a step's token rows, those whose logits the step keeps (kept_rows: each entry's last)."""
    rows, total = [], 0
    for seq, count in scheduled:
        total += count
        rows.extend(range(total - kept_rows(seq, count), total))
    return rows


def batch_of(scheduled: list[tuple[Sequence, int]], block_size: int, device: torch.device,
             decode_rows: DecodeRows = DecodeRows()) -> Batch:
    """A step's (sequence, tokens) rows packed for the model, the rows `decode_rows` picks as
    one-token decodes."""
    ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
    last = logit_rows(scheduled)
    parts: list[np.ndarray] = []  # (3, n) ids, positions, slots: short rows' lists, long chunks
    total = 0
    for seq, count in scheduled:
        start, blocks = seq.num_cached, seq.blocks.blocks
        if count > LONG_CHUNK and not seq.draft:
            if ids:
                parts.append(np.array([ids, positions, slots], dtype=np.int64))
                ids, positions, slots = [], [], []
            at = np.arange(start, start + count, dtype=np.int64)
            table = np.array(blocks, dtype=np.int64)
            parts.append(np.stack([np.array(seq.tokens[start:start + count], dtype=np.int64), at,
                                   table[at // block_size] * block_size + at % block_size]))
        else:
            ids.extend((seq.tokens + seq.draft if seq.draft else seq.tokens)[start:start + count])
            for position in range(start, start + count):
                positions.append(position)
                slots.append(blocks[position // block_size] * block_size + position % block_size)
        total += count
        if count > 1 and decode_rows(seq, count):
            query_lens.extend([1] * count)
            context_lens.extend(range(start + 1, start + count + 1))
            tables.extend([blocks] * count)
        else:
            query_lens.append(count)
            context_lens.append(start + count)
            tables.append(blocks)
    if ids or not parts:
        parts.append(np.array([ids, positions, slots], dtype=np.int64).reshape(3, -1))
    # One copy to the device (each tensor made from a list is a copy and a wait of its own), each
    # part 16 bytes in: Triton compiles a kernel per pointer aligned so or not (the slots').
    width = total + total % 2
    packed = np.zeros(3 * width + len(last), dtype=np.int64)
    packed[:3 * width].reshape(3, width)[:, :total] = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    packed[3 * width:] = last
    packed = torch.from_numpy(packed)
    packed = packed.to(device, non_blocking=True) if device.type == "cuda" else packed
    return Batch(
        input_ids=packed[:total], positions=packed[width:width + total], slots=packed[2 * width:2 * width + total],
        query_lens=query_lens, context_lens=context_lens, block_tables=tables, last_token_index=packed[3 * width:],
        block_size=block_size)

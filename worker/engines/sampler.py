"""Batched sampling on the logits' device: penalties, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import torch

from typing import Any, Protocol

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton
    triton = None

from worker.engines import logprobs as lp
from worker.request import GenerationRequest, SamplingParams


class Row(Protocol):
    """What choose() reads of a request being decoded."""

    request: GenerationRequest
    generator: Draws | None
    output_ids: list[int]
    matcher: Any


class Rows:
    """What choose() reads of a batch's rows, gathered once: a decode step launched ahead of the
    last one's tokens has that step's rows. At batch 256 on an H100 host, reusing them (and checking
    each sequence's end with one comparison) took launching a step ahead from ~1.1 to ~0.8 ms of the
    engine thread, against a 2.6 ms step."""

    def __init__(self, rows: list[Row]):
        self.rows = rows
        self.asked = [row for row, r in enumerate(rows) if r.request.logprobs is not None]
        self.matched = [row for row, r in enumerate(rows) if r.matcher is not None]
        self.params = [r.request.sampling for r in rows]
        self.greedy = all(p.is_greedy and not p.is_penalized for p in self.params)
        # No row needs its last token on the host before it is sampled (the grammar's state, the
        # output so far, which logprobs record).
        self.plain = not self.asked and not self.matched and not any(p.is_penalized for p in self.params)
        self.limits: Limits | None = None  # the params sample() reads, built at its first step


def choose(logits: torch.Tensor, rows: Rows, grammars: Any) -> tuple[torch.Tensor, lp.Pending | None]:
    """The next token of each row, and the logprobs of those rows that asked (in their order): the
    logprobs from the raw logits, then the grammars' masks, then sampling. Modifies logits."""
    asked, every = rows.asked, rows.rows
    raw = lp.log_softmax(logits[asked] if len(asked) < len(every) else logits) if asked else None
    # A grammar that has accepted its stop token has no next mask: its row, computed a step ahead
    # for a sequence that token ended, is dropped unread.
    constrained = [row for row in rows.matched if not every[row].matcher.is_terminated()]
    if constrained:
        grammars.mask(logits, constrained, [every[row].matcher for row in constrained])
    if not rows.greedy and rows.limits is None:
        rows.limits = Limits(rows.params, logits.shape[-1], logits.device)
    tokens = argmax(logits) if rows.greedy else sample(
        logits, rows.params, [r.generator for r in every], [r.request.prompt_token_ids for r in every],
        [r.output_ids for r in every], rows.limits)
    if raw is None:
        return tokens, None
    chosen = tokens[asked] if len(asked) < len(every) else tokens
    return tokens, lp.sampled(raw, chosen, [every[row].request.logprobs for row in asked])


class Draws:
    """A sampled request's uniform draws in [0, 1), from its own generator on the host, taken BLOCK
    at a time: the same seed gives the same draws whatever shares the batch. A step's draws, one a
    sampled row, go over to the device in one copy (inverse_cdf); drawn on a CUDA generator each was
    a launch of its own (~0.5 ms of the engine thread a step at batch 64 on an H100 host), and on
    the host a torch call each was still ~3 us a row."""

    BLOCK = 64

    def __init__(self, seed: int | None):
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed % (1 << 63))
        else:
            self.generator.seed()
        self._left: list[float] = []

    def next(self) -> float:
        if not self._left:
            self._left = torch.rand(self.BLOCK, generator=self.generator).tolist()[::-1]
        return self._left.pop()


def make_generator(params: SamplingParams) -> Draws | None:
    """The request's draws; None for a greedy one, which draws nothing."""
    return None if params.is_greedy else Draws(params.seed)


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (HF/vLLM), presence and frequency over output."""
    for row, p in enumerate(params):
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt_ids[row]) | set(output_ids[row])), device=logits.device)
            if seen.numel():
                values = logits[row, seen]
                logits[row, seen] = torch.where(
                    values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output_ids[row]:
            ids = torch.tensor(output_ids[row], device=logits.device)
            counts = torch.zeros(logits.shape[-1], device=logits.device, dtype=logits.dtype)
            counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's first largest value. On CUDA torch's reduction takes one thread block a
    row: for a 128k vocabulary on an H100, about 0.1 ms for one row (7% of a batch-1 decode step),
    28 us for 16 or 64 rows (2% of a batch-64 step) and 48 for 256. Here each row is split in
    chunks, each chunk's first maximum taken, then the first chunk holding the row's maximum: 5.2,
    7.4 and 27 us with Triton (64 chunks a row up to 16 rows, 16 past that), in one kernel whose last
    chunk of a row to finish picks the row's: on an H200 host a call took the engine thread 37-54 us
    (1-256 rows of 49k or 128k logits), against 47-77 with a second kernel for that and two more
    allocations. Few rows without Triton: four of torch's kernels (pad, max, argmax, gather: 18 us)."""
    rows, vocab = logits.shape
    fast = triton is not None and logits.stride(-1) == 1
    if not logits.is_cuda or vocab < 16384 or (rows > 16 and not fast):
        if logits.device.type == "cpu" and logits.dtype != torch.float32:
            logits = logits.float()  # torch's CPU argmax on bf16 took twice a float copy and argmax
        return logits.argmax(dim=-1)
    chunks = 64 if rows <= 16 else 16
    size = -(-vocab // chunks)
    if fast:
        # One allocation, int64: the rows' tokens (rows,), then per row each chunk's first maximum's
        # index and its value (fp32 in the low half of an int64), (rows, 2 * chunks)
        out = torch.empty(rows * (1 + 2 * chunks), dtype=torch.int64, device=logits.device)
        _chunk_max_kernel[(rows, chunks)](logits, out, out[rows:], _arrivals(logits.device, rows), vocab,
                                          logits.stride(0), size, BLOCK=triton.next_power_of_2(size),
                                          CHUNKS=chunks, num_warps=8 if size > 4096 else 4)
        return out[:rows]
    padded = torch.nn.functional.pad(logits, (0, chunks * size - vocab), value=float("-inf"))
    values, within = padded.view(rows, chunks, size).max(dim=-1)
    chunk = values.argmax(dim=-1, keepdim=True)
    return (chunk * size + within.gather(1, chunk))[:, 0]


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrivals(device: torch.device, rows: int) -> torch.Tensor:
    """Per row, how many of its chunks argmax's kernel has finished; the last sets it back to 0.
    Kept for the process (a larger one replaces it, in stream order)."""
    if device not in _ARRIVALS or len(_ARRIVALS[device]) < rows:
        _ARRIVALS[device] = torch.zeros(max(rows, 256), dtype=torch.int32, device=device)
    return _ARRIVALS[device]


if triton is not None:

    @triton.jit
    def _chunk_max_kernel(logits_ptr, out_ptr, parts_ptr, arrivals_ptr, vocab, stride, size, BLOCK: tl.constexpr,
                          CHUNKS: tl.constexpr):
        """Per (row, chunk): the chunk's largest value and the index in the row of its first
        occurrence, into parts (see argmax); the row's last chunk to finish then writes the index
        held by the first chunk among those holding the row's largest value."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        index = chunk * size + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride + index, mask=(index < vocab) & (tl.arange(0, BLOCK) < size),
                    other=float("-inf")).to(tl.float32)
        best = tl.max(x, 0)
        first = tl.min(tl.where(x == best, index, 2 ** 31 - 1), 0)  # the first index holding it
        parts = parts_ptr + row * 2 * CHUNKS
        tl.store(parts + chunk, first.to(tl.int64))
        tl.store(parts + CHUNKS + chunk, best.to(tl.int32, bitcast=True).to(tl.int64))
        tl.debug_barrier()  # every thread's stores before the release of the arrival
        if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel") == CHUNKS - 1:  # the others' stores are visible
            chunks = tl.arange(0, CHUNKS)
            bits = tl.load(parts + CHUNKS + chunks, cache_modifier=".cg").to(tl.int32)
            values = bits.to(tl.float32, bitcast=True)
            top = tl.min(tl.where(values == tl.max(values, 0), chunks, CHUNKS), 0)
            tl.store(out_ptr + row, tl.load(parts + top, cache_modifier=".cg"))
            tl.atomic_xchg(arrivals_ptr + row, 0)


def on_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A list as a tensor on `device` without waiting for it: on CUDA copied from pinned memory.
    From pageable memory (torch.tensor(..., device=...), a list index) CUDA syncs the stream before
    the copy, so the engine thread waited there for the forward it had just queued."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


class Limits:
    """What sample() reads of its rows' params, on the logits' device: the temperatures (B,), the
    sampled rows without truncation (`plain`) and with it (`cut`, top-k / top-p / min-p), and the
    latter's limits. Built once for a Rows, which steps launched ahead share."""

    def __init__(self, params: list[SamplingParams], vocab: int, device: torch.device):
        self.temperature = on_device([p.temperature or 1.0 for p in params], device)
        self.plain = [row for row, p in enumerate(params) if not p.is_greedy and not p.truncates(vocab)]
        self.cut = [row for row, p in enumerate(params) if not p.is_greedy and p.truncates(vocab)]
        self.plain_rows = on_device(self.plain, device, torch.long) if self.plain else None
        self.cut_rows = on_device(self.cut, device, torch.long) if self.cut else None
        self.top = tuple(on_device(values, device) for values in _top([params[row] for row in self.cut], vocab)) \
            if self.cut else None


def _top(params: list[SamplingParams], vocab: int) -> tuple[list, list, list]:
    """(top-k, top-p, min-p) of each of `params`; top-k 0 (off) read as the vocabulary's size."""
    return [p.top_k or vocab for p in params], [p.top_p for p in params], [p.min_p for p in params]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[Draws | None],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    limits: Limits | None = None,
) -> torch.Tensor:
    """Next token per row of logits (B, V): a (B,) int64 tensor on the logits' device. Nothing here
    waits for the device (penalties aside), so a caller may queue more work before it reads the
    tokens. `limits`: Limits(params, ...), when the caller keeps them."""
    if all(p.is_greedy and not p.is_penalized for p in params):
        return argmax(logits)  # any dtype: a float copy would change no order
    logits = apply_penalties(logits.float(), params, prompt_ids, output_ids)
    greedy = argmax(logits)
    if all(p.is_greedy for p in params):
        return greedy
    limits = limits or Limits(params, logits.shape[-1], logits.device)
    probs = torch.softmax(logits / limits.temperature[:, None], dim=-1)  # (B, V)
    # Only rows with top-k, top-p or min-p need their probabilities sorted: at batch 8 and a 49k
    # vocabulary the sort was half of sampling's time, which the other rows skip. Each row draws one
    # uniform number from its own generator and takes the token where it falls in the cumulative
    # probabilities (the exponential race it replaces drew a number per token: 1 ms a row on a CPU).
    tokens = greedy.clone()
    if limits.plain:
        drawn = inverse_cdf(probs.index_select(0, limits.plain_rows), [generators[row] for row in limits.plain])
        tokens.index_copy_(0, limits.plain_rows, drawn)
    if limits.cut:
        kept, order = _truncated(probs.index_select(0, limits.cut_rows), *limits.top)
        ranks = inverse_cdf(kept, [generators[row] for row in limits.cut])
        tokens.index_copy_(0, limits.cut_rows, order.gather(1, ranks[:, None])[:, 0])
    return tokens


def distribution(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What sample() draws each row of logits (R, V) from, for one request's params (sampled, no
    penalties), computed as sample() computes it: (probabilities, None) in vocabulary order, or with
    top-k, top-p or min-p (sorted probabilities with the dropped ones 0, the token ids by rank).
    inverse_cdf() on a row with the request's generator draws what sample() would."""
    temperature = torch.full((len(logits),), params.temperature, device=logits.device)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    if params.truncates(logits.shape[-1]):
        top = _top([params] * len(logits), logits.shape[-1])
        return _truncated(probs, *(on_device(values, logits.device) for values in top))
    return probs, None


def inverse_cdf(probs: torch.Tensor, generators: list[Draws]) -> torch.Tensor:
    """(R,) indices drawn from each row of probs (R, V), which need not sum to 1; zeros never drawn."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    draws = on_device([g.next() for g in generators], probs.device, torch.float32)
    # Below the total even where draw * total rounds up to it, and the first index whose running
    # total exceeds the point (right=True): a token of probability 0 is never the one found.
    points = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, points[:, None], right=True)[:, 0]


def _truncated(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of probs sorted in descending order with what top-k, top-p and min-p (one each a row)
    drop set to 0, and the sort's order (token ids by rank)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (ranks >= top_k[:, None]) | (mass_before >= top_p[:, None])
    drop |= sorted_probs < (min_p * sorted_probs[:, 0])[:, None]
    drop[:, 0] = False  # the most likely token always survives
    return sorted_probs.masked_fill(drop, 0.0), order

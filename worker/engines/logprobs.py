"""Log-probabilities from logits a step already has: the model's raw log-softmax in fp32, before
penalties, temperature, truncation and structured-output masks (what vLLM reports by default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.request import TokenLogprob

# Rows of (rows, vocab) fp32 worked on at once for a prompt: 256 x 128k x 4 bytes is 128 MiB.
PROMPT_ROWS = 256


@dataclass(slots=True)
class Pending:
    """Logprobs of sampled tokens, still on the logits' device: read() brings them to the host."""

    chosen: torch.Tensor  # (R,) fp32
    top_values: torch.Tensor | None  # (R, k) fp32, k the most any row asked for
    top_ids: torch.Tensor | None  # (R, k)
    counts: list[int]  # alternatives each row asked for

    def read(self, tokens: list[int]) -> list[TokenLogprob]:
        chosen = self.chosen.tolist()
        values = self.top_values.tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        return [TokenLogprob(token, chosen[row], list(zip(ids[row][:count], values[row][:count])) if count else [])
                for row, (token, count) in enumerate(zip(tokens, self.counts))]


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def sampled(logprobs: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> Pending:
    """Logprobs (from log_softmax) of each row's sampled token and of its `counts[row]` most likely
    tokens; queued on the device, nothing waits here."""
    chosen = logprobs.gather(1, tokens.view(-1, 1).to(logprobs.device)).view(-1)
    k = max(counts)
    top = logprobs.topk(k, dim=-1) if k else None
    return Pending(chosen, top.values if top else None, top.indices if top else None, counts)


def of_prompt(logits: torch.Tensor, next_ids: list[int], count: int) -> list[TokenLogprob]:
    """Logprobs of prompt tokens from the logits of the positions before them: row i of logits (R, V)
    predicts next_ids[i]. Works through the rows in slices so a long prompt never holds them all in fp32."""
    out: list[TokenLogprob] = []
    for start in range(0, len(next_ids), PROMPT_ROWS):
        ids = next_ids[start:start + PROMPT_ROWS]
        out.extend(sampled(log_softmax(logits[start:start + len(ids)]),
                           torch.tensor(ids, device=logits.device), [count] * len(ids)).read(ids))
    return out


def from_ranked(token_ids: Any, entries: Any, count: int | None) -> list[TokenLogprob]:
    """vLLM's and TensorRT-LLM's per-position {token id: Logprob(logprob, rank)} (the chosen token
    and the top `count`) as ours; a None position (the prompt's first token) has no logprob."""
    if count is None or entries is None:
        return []
    out = []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            out.append(TokenLogprob(token_id, None))
            continue
        ranked = sorted((item for item in entry.items() if item[1].rank is not None and item[1].rank <= count),
                        key=lambda item: item[1].rank)
        out.append(TokenLogprob(token_id, entry[token_id].logprob, [(i, e.logprob) for i, e in ranked][:count]))
    return out

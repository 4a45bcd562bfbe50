"""TEST DOUBLE of the native engine's CUDA decode graphs (worker/engines/native/graphs.py), so that the
steps the engine launches ahead (worker/engines/native/ahead.py) run in CI, which has no GPU: the
same interface, each step run eagerly on the CPU as one-token decode rows of the model. Nothing of
the graphs themselves (capture, static buffers, padding, pinned copies) is exercised here; that is
tests/test_native_cuda.py's, on a GPU."""

from __future__ import annotations

import torch

from worker.engines.native.batch import Batch
from worker.engines.native.sequence import logit_rows


class EagerGraphs:
    def __init__(self, model, k_cache: torch.Tensor, v_cache: torch.Tensor, max_batch: int):
        self.model, self.k_cache, self.v_cache = model, k_cache, v_cache
        self.sizes = [max_batch]

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def decode(self, seqs: list, block_size: int, pending: torch.Tensor | None = None) -> torch.Tensor:
        """As DecodeGraphs.decode: each sequence's last known token, or with `pending` the token after it."""
        if pending is None:
            return self._run([(seq, seq.num_cached, [seq.tokens[seq.num_cached]]) for seq in seqs], block_size)
        return self._run([(seq, len(seq.tokens), [token]) for seq, token in zip(seqs, pending.tolist())], block_size)

    def rows(self, scheduled: list, block_size: int, ahead: list = (), pending: torch.Tensor | None = None) -> torch.Tensor:
        """As DecodeGraphs.rows: `ahead`'s pending tokens, then a row for every token of `scheduled`;
        the logits of the former and of each entry's kept rows."""
        runs = [(seq, len(seq.tokens), [token]) for seq, token in zip(ahead, pending.tolist())] if ahead else []
        runs += [(seq, seq.num_cached, (seq.tokens[seq.num_cached:seq.num_cached + count] + seq.draft)[:count])
                 for seq, count in scheduled]
        return self._run(runs, block_size)[[*range(len(ahead)), *(len(ahead) + row for row in logit_rows(scheduled))]]

    def checks(self, seqs: list, positions: list[int], drafts: list[list[int]], block_size: int,
               pending: torch.Tensor) -> torch.Tensor:
        """As DecodeGraphs.checks: each sequence's pending token at its position, then its draft."""
        return self._run([(seq, position, [token, *draft]) for seq, position, token, draft
                          in zip(seqs, positions, pending.tolist(), drafts)], block_size)

    def _run(self, runs: list[tuple], block_size: int) -> torch.Tensor:
        """Logits of a one-token decode row for each token of each (sequence, first position, ids)."""
        ids, positions, slots, tables = [], [], [], []
        for seq, first, tokens in runs:
            table = seq.blocks.blocks
            for position, token in enumerate(tokens, start=first):
                ids.append(token)
                positions.append(position)
                slots.append(table[position // block_size] * block_size + position % block_size)
                tables.append(table)
        batch = Batch(input_ids=torch.tensor(ids), positions=torch.tensor(positions), slots=torch.tensor(slots),
                      query_lens=[1] * len(ids), context_lens=[p + 1 for p in positions], block_tables=tables,
                      last_token_index=torch.arange(len(ids)), block_size=block_size)
        return self.model(batch, self.k_cache, self.v_cache)

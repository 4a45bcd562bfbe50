"""Steps launched ahead (CUDA, with overlap): the native engine's next step queued before the tokens
of the step running reach the host, fed with those tokens on the device, so that the host's work
for a step runs while the device computes the one before.

Two kinds: the decode step after a step whose every row samples (decodes), and the check after a
step of checks only, with a run for each number of its proposals that may be accepted (checks).
Both go through the CUDA graphs. `engine`: a loaded NativeEngine on its engine thread.
"""

from __future__ import annotations

import itertools

from worker.engines.native.sequence import Step, pick
from worker.engines.sampler import Rows


def launch(engine, step: Step) -> Step | None:
    """The step after `step`, launched, where it is known before `step`'s tokens are; else None
    (the engine schedules it once they are read)."""
    if engine.graphs is None:
        return None
    if step.verifying:
        return checks(engine, step) if len(step.verifying) == len(step.scheduled) else None
    return decodes(engine, step)


def decodes(engine, step: Step) -> Step | None:
    """The decode step after `step` (its tokens go from the sampler into the graph's inputs on the
    device), where that step is known: every row of `step` samples, Batcher.ahead knows the rows
    (short prompts may join), and proposing lately paid (Speculator.schedules_next). Sequences
    ended, or whose pending token is their last by length, get no row; rows a pending EOS or stop
    id ends are computed and dropped, their slot writes in blocks that stream order keeps from
    anyone else until this step is done."""
    seqs, graphs = step.ready, engine.graphs
    if (not seqs or len(seqs) != len(step.scheduled) or len(seqs) > graphs.max_batch
            or any(seq.proposer and seq.proposer.active for seq in seqs) and engine.speculator.schedules_next()):
        return None
    left = [-1 if seq.done else seq.end - len(seq.tokens) for seq in seqs]  # tokens to come, pending one's too
    kept = [i for i, count in enumerate(left) if count > 1]
    live = seqs if len(kept) == len(seqs) else [seqs[i] for i in kept]
    scheduled = engine.batcher.ahead(live, graphs.max_batch, engine.decode_rows)
    if not scheduled:
        return None
    pending = step.tokens if live is seqs else pick(step.tokens, kept)
    joined, block_size = scheduled[len(live):], engine.blocks.block_size
    if 2 in left:  # this step makes their last token (a pass over 256 rows costs ~10 us: only then)
        engine._ends += [seqs[i].stream for i, count in enumerate(left) if count == 2]
    engine._ends += [seq.stream for seq, _ in joined if seq.ends_with_next()]
    if joined:
        ahead = Step(scheduled, ready=live + [seq for seq, _ in joined],
                     logits=graphs.rows(joined, block_size, ahead=live, pending=pending if live else None))
    else:
        ahead = Step(scheduled, ready=live, logits=graphs.decode(live, block_size, pending))
    ahead.rows = step.rows if ahead.ready is seqs else Rows(ahead.ready)  # sampled as they were
    # A row that needs its last token on the host first is sampled once `step` is read.
    return ahead.sample(engine.grammars) if ahead.rows.plain else ahead


def checks(engine, step: Step) -> Step | None:
    """The check after `step` (a step of checks only), launched before its outcome is read: for
    each sequence, the rows that stand of `step` (Step.standing) checked k proposals; the next step
    holds a run for every outcome, j of them accepted (0 <= j <= k), each the model's token after
    proposal j (its argmax on the device) at the position it then takes. The run of j = k also
    checks what follows in the source of the proposals (Proposer.follow). When `step` is read, one
    run of each sequence stands and the others are dropped unread: their slot writes lie past its
    tokens (written again before anything reads them), or are its own tokens again. So a rejected
    proposal costs no step of its own, nor does it end the chain for the batch: a check that
    assumed every proposal accepted was dropped after a rejection, and a step scheduled for the
    token chosen there (a quarter of the time at batch 1 on an H100, SmolLM2 rewrites); at batch 8
    the rewrites went from 1.33x to 1.60x (medians of six runs), batch 1 unchanged within the runs'
    spread. Greedy sequences only (that token is an argmax), with no prompt waiting to join; a step
    of sequences none of which proposes may be scheduled instead (Speculator.schedules_next), so
    that they propose again."""
    if engine.batcher.waiting or step.targets is None:
        return None
    standing = step.standing()
    if sum(standing) != step.num_seqs:  # one ended, or its outcome has no run
        return None
    starts = list(itertools.accumulate((1 + len(draft) for draft in step.drafts), initial=0))
    live = [(step.verifying[i], step.drafts[i], step.bases[i], starts[i])
            for i, stands in enumerate(standing) if stands]  # (sequence, draft, first position, first row)
    if any(not seq.request.sampling.is_greedy or base + len(draft) + 2 >= seq.end for seq, draft, base, _ in live):
        return None  # (not greedy, or the token after the draft's may be its last)
    if (not any(draft for _, draft, _, _ in live) and any(seq.proposer.active for seq, _, _, _ in live)
            and engine.speculator.schedules_next()):
        return None
    follows = [seq.proposer.follow(seq.tokens, seq.end - base - len(draft) - 3) if draft and seq.proposer.active else []
               for seq, draft, base, _ in live]  # k at most, as a whole check's
    if sum(len(draft) + 1 + len(follow) for (_, draft, _, _), follow in zip(live, follows)) > engine.graphs.max_batch:
        return None
    blocks, seqs, positions, drafts, pending = engine.blocks, [], [], [], []
    for (seq, draft, base, at), follow in zip(live, follows):
        if not blocks.can_grow(seq.blocks, base + len(draft) + 2 + len(follow)):
            return None
        blocks.grow(seq.blocks, base + len(draft) + 2 + len(follow))
        for accepted in range(len(draft) + 1):
            seqs.append(seq)
            positions.append(base + accepted + 1)
            drafts.append(follow if accepted == len(draft) else [])
            pending.append(at + accepted)
    tokens = step.targets[pending[0]:pending[0] + 1] if len(pending) == 1 else pick(step.targets, pending)
    ahead = Step([(seq, 1 + len(draft)) for seq, draft in zip(seqs, drafts)])
    ahead.check(engine.graphs.checks(seqs, positions, drafts, blocks.block_size, tokens), seqs, drafts, positions)
    return ahead

"""Steps launched ahead (CUDA, with overlap): the native engine's next step queued before the tokens
of the step running reach the host, fed with those tokens on the device, so that the host's work
for a step runs while the device computes the one before.

Two kinds: the decode step after a step whose every row samples (decodes), and the check after a
step of checks only, as if each of its proposals were accepted (checks). Both go through the CUDA
graphs. `engine`: a loaded NativeEngine on its engine thread.
"""

from __future__ import annotations

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
    """The check after `step` (a step of checks only), as if each of its sequences' proposals were
    accepted: its next row takes the token the model chose after its last proposal (on the
    device), then what follows in the source of its proposals (Proposer.follow). A sequence that
    has a proposal rejected has these rows dropped when read (engine._verified); their slot writes
    lie past its tokens, written again before anything reads them. Greedy sequences only (that
    token is an argmax), with no prompt waiting to join.
    At batch 1 on an H100 (SmolLM2, rewrites) a check scheduled once the one before was read came
    every 1.37-1.40 ms, its host work and the device's one after the other."""
    if engine.batcher.waiting or step.targets is None or not all(step.standing()):
        return None
    blocks, positions, drafts, pending, at = engine.blocks, [], [], [], 0
    for seq, draft, base in zip(step.verifying, step.drafts, step.bases):
        position = base + len(draft) + 1  # of the token after the draft's
        if not seq.request.sampling.is_greedy or not seq.proposer.active or position + 1 >= seq.end:
            return None  # (not greedy, paused, or the token after the draft's is its last)
        follow = seq.proposer.follow(seq.tokens, seq.end - position - 2)  # k at most, as a whole check's
        if not blocks.can_grow(seq.blocks, position + 1 + len(follow)):
            return None
        blocks.grow(seq.blocks, position + 1 + len(follow))
        positions.append(position)
        drafts.append(follow)
        pending.append(at + len(draft))
        at += 1 + len(draft)
    if len(drafts) + sum(map(len, drafts)) > engine.graphs.max_batch:
        return None
    seqs = step.verifying
    tokens = step.targets[pending[0]:pending[0] + 1] if len(seqs) == 1 else pick(step.targets, pending)
    ahead = Step([(seq, 1 + len(draft)) for seq, draft in zip(seqs, drafts)])
    ahead.check(engine.graphs.checks(seqs, positions, drafts, blocks.block_size, tokens), seqs, drafts, positions)
    return ahead

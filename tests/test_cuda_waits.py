"""What the native engine's thread does not wait for on CUDA (these tests skip without a CUDA GPU):
each test queues ~1 s of the device's time first, then times the call that must not wait for it."""

import time

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's stream is what a list index waits for")
def test_a_step_picks_its_logit_rows_without_waiting_for_the_forward():
    """A verify step picks its draft rows' logits, and a step with prompt chunks its last rows', as
    it is queued: the index goes over from pinned memory, where a list index (copied from pageable
    memory) waited for the stream, so the engine thread idled through the forward (32-44% of its
    time speculating on an H100) instead of emitting the last step's tokens meanwhile."""
    from worker.engines.native.sequence import pick

    logits = torch.randn(8, 16, device="cuda")
    expected = logits[[1, 3, 4]]
    pick(logits, [0, 2, 5])  # a process's first pinned allocation and copy kernel load synchronize
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the stream's time, before the rows are picked
    started = time.monotonic()
    picked = pick(logits, [1, 3, 4])
    waited = time.monotonic() - started
    torch.cuda.synchronize()
    assert waited < 0.2, f"picking the rows waited {waited:.2f} s for the stream"
    assert torch.equal(picked, expected)
    assert torch.equal(pick(logits.cpu(), [1, 3, 4]), expected.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's stream is what a list copied to it waits for")
def test_a_step_of_prompts_beside_decodes_is_prepared_without_waiting_for_the_one_before():
    """A step that runs prompts beside decodes (a burst's prefill) indexes its decode rows as it is
    queued: each index goes over from pinned memory. Made from lists (pageable memory) they waited
    for the stream, so such a step's forward was queued only once the step before had finished."""
    from worker.engines.native.batch import Batch

    def batch() -> Batch:  # a fresh prompt of 4, a decode at 10 tokens, 3 tokens after 16 cached
        ids = torch.arange(8, device="cuda")
        return Batch(ids, ids, ids, [4, 1, 3], [4, 10, 19], [[0], [1], [2, 3]],
                     torch.tensor([3, 4, 7], device="cuda"), 16)

    batch().prepare(64, 8)  # a process's first pinned allocation and copy kernel load synchronize
    step = batch()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the stream's time, before the step is prepared
    started = time.monotonic()
    step.prepare(64, 8)
    waited = time.monotonic() - started
    torch.cuda.synchronize()
    assert waited < 0.2, f"preparing the step waited {waited:.2f} s for the stream"
    assert step.decode_index.tolist() == [4] and step.decode_lens.tolist() == [10]
    assert step.decode_tables[:, 0].tolist() == [1] and step.fresh == [(0, 1, 4, None)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy's own stream is CUDA's")
def test_a_steps_tokens_go_to_the_host_off_the_stream_that_runs_the_next_step():
    """to_host copies once what computes the tokens is done, on a stream of its own: work queued
    next on the device's stream does not wait for the copy, and the tokens' memory is not handed
    to another tensor before the copy has read it."""
    from worker.engines.native.sequence import copy_stream, to_host

    tokens = torch.zeros(64, dtype=torch.long, device="cuda")
    to_host(tokens)[1].synchronize()  # a process's first pinned allocation synchronizes
    torch.cuda._sleep(200_000_000)  # the tokens are written after ~0.1 s of the stream's time
    tokens.fill_(7)
    side = copy_stream(tokens.device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # then the copy's stream is busy for ~1 s more
    host, copied = to_host(tokens)
    del tokens
    reused = torch.empty(64, dtype=torch.long, device="cuda").fill_(3)  # what a next step allocates
    queued = torch.cuda.Event()
    queued.record()
    started = time.monotonic()
    queued.synchronize()
    waited = time.monotonic() - started
    assert waited < 0.4, f"the device's stream waited {waited:.2f} s for the copy"
    assert not copied.query()
    copied.synchronize()
    assert host.tolist() == [7] * 64  # the tokens once written, not before, nor the next tensor's
    assert reused.tolist() == [3] * 64
    torch.cuda._sleep(1_000_000_000)  # with the copy's stream idle, the copy still waits for them
    reused.fill_(9)
    host, copied = to_host(reused)
    copied.synchronize()
    assert host.tolist() == [9] * 64

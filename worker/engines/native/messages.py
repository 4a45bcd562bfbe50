"""A step's tokens as each stream's text and messages: stop strings and finish reasons, and the
messages paced so that consumers on the event loop wake no more often than the server sends."""

from __future__ import annotations

import time

from worker.engines.base import RequestStream, message_spacing
from worker.engines.native.sequence import Outbox, Sequence
from worker.request import RequestOutput

MIN_SPACING_S = 0.0005
"""Messages closer than this are not held back (the servicer's threshold too)."""
BURST_S = 0.002
"""Seconds of max_messages_per_s that a step may send beyond what the time since the last one earned."""


class Messages:
    """A sequence's first and last tokens go out at once; the others once `running streams /
    max_messages_per_s`, and at least min_interval_s, has passed since its last message, riding
    together, as the servicer spaces gRPC streams (server.max_messages_per_s and
    min_message_interval_s). Paced at the source, every consumer wakes that much
    less, and they share the GIL with the engine thread (a tiny model on the 2-core CPU, where the
    host is what a step costs: batch 256, 5.5 ms a step against 4.3 paced; batch 64, 1.25 against
    1.11).

    The rate holds for the worker as a whole, step by step: streams that started together would
    otherwise all be due in the same step, every spacing, and that step's messages (25 us each on
    an H100 host) held the device idle for 5-7 ms at batch 256 while the steps between had time to
    spare. Due messages past what the time since the last step allows wait a step, so the streams'
    turns spread over the steps."""

    def __init__(self, max_messages_per_s: float, min_interval_s: float = 0.0):
        self.max_messages_per_s = max_messages_per_s
        self.min_interval_s = min_interval_s  # each stream's, however few run (server.min_message_interval_s)
        self._allowance = 0.0  # messages the rate allows beyond those sent, at the last step
        self._last = 0.0  # monotonic time of the last step's messages

    def of(self, sampled: list[tuple[Sequence, list[int]]],
           running: int) -> tuple[list[tuple[RequestStream, RequestOutput]], list[Sequence]]:
        """(stream, message) to send for the tokens just read, and the sequences that ended with
        them (those a stop string ended are still for the engine to drop). A held sequence's tokens become text when its message goes,
        in one pass (at batch 256 this thread's work a token is what a step costs), unless it has
        stop strings, which must be found as soon as they appear."""
        sent, ended = [], []
        now = time.monotonic()
        rate = self.max_messages_per_s
        spacing = message_spacing(running, rate, self.min_interval_s)
        paced = spacing > MIN_SPACING_S
        if not paced:
            allowance = 0.0
        elif rate:
            allowance = rate * (now - self._last) + min(self._allowance, rate * BURST_S)
        else:  # the interval alone spaces them
            allowance = float("inf")
        for seq, tokens in sampled:
            if seq.aborted:  # its stream already has its last message
                continue
            box = seq.outbox
            box.ids.extend(tokens)
            if seq.logprob:
                box.logprobs.append(seq.logprob)
            held = paced and not seq.done and box.sent_at and (now - box.sent_at < spacing or allowance < 1)
            if held and not seq.request.sampling.stop:
                continue
            finish = self.read(seq)
            if finish is not None:
                ended.append(seq)
            elif held:
                continue
            allowance -= 1
            sent.append((seq.stream, self.take(seq, finish, now)))
        if sampled:
            self._allowance, self._last = max(allowance, 0.0), now
        return sent, ended

    def flush(self, seq: Sequence) -> RequestOutput:
        """What the outbox holds, as a message now (a preempted sequence makes no tokens for a while)."""
        return self.take(seq, self.read(seq), time.monotonic())

    @staticmethod
    def read(seq: Sequence) -> str | None:
        """Turns the outbox's unread tokens into text; the finish reason, where one ends the request
        (the tokens after a stop string are dropped)."""
        box, params = seq.outbox, seq.request.sampling
        if box.read == len(box.ids):
            return None
        # Before the sequence samples again, so its state is still that of the last token.
        text, finish, taken = seq.text.add_all(box.ids[box.read:], params.stop_token_ids, params.ignore_eos,
                                               seq.at_limit())
        del box.ids[box.read + taken:]
        box.read = len(box.ids)
        box.text += text
        return finish

    @staticmethod
    def take(seq: Sequence, finish: str | None, now: float) -> RequestOutput:
        """The outbox as one message, emptied; the first message carries the prompt's logprobs."""
        box = seq.outbox
        output = RequestOutput(text=box.text, token_ids=box.ids, finish_reason=finish, logprobs=box.logprobs)
        if seq.prompt_logprobs is not None and not box.sent_at:
            output.prompt_logprobs = seq.prompt_logprobs
        seq.outbox = Outbox(sent_at=now)
        return output

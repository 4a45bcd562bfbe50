"""Token ids to text deltas that are always whole UTF-8 characters, and stop strings applied to them."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing list of ids into new text, holding back bytes of an unfinished character.

    A fast tokenizer streams through its Rust DecodeStream, one call a token; others decode a short
    window of recent ids with some context before it (vLLM's prefix/read offsets), twice a token.
    Either way leading-space and byte-fallback tokens come out right.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        context = prompt_ids[-6:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        # A fast tokenizer's Rust decode, without transformers' per-call Python around it, when
        # that wrapper would not change the text (it only adds the clean-up of spaces).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=True)
            self._backend, self._stream = backend, _decode_stream(context)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._stream is None:
            return self._advance(final=False)
        text = self._stream.step(self._backend, token_id)
        if text is None:  # an unfinished character: held back, the window's offsets stay
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]


def _decode_stream(context: list[int]) -> Any:
    """tokenizers' DecodeStream primed with the prompt's last ids; None where it is too old for that."""
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=context, skip_special_tokens=True)
    except (ImportError, TypeError):
        return None


class StopStrings:
    """Cuts the text at the first stop string and holds back a tail that may begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, delta: str) -> str:
        """Returns the text now safe to send; sets `stopped` once a stop string appears."""
        if not self.stops:
            return delta
        search_from = max(0, len(self.text) - max(map(len, self.stops)) + 1)
        self.text += delta
        hits = [i for i in (self.text.find(stop, search_from) for stop in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        else:
            end = len(self.text) - self._held_back()
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def flush(self) -> str:
        """At the end of generation nothing can begin a stop string any more."""
        if self.stopped:
            return ""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    def _held_back(self) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class OutputText:
    """One request's generated text: detokenized, cut at stop strings, finished by EOS, stop ids or length.

    `render` False (no stop strings only): add_all gives the finish reason and no text, which
    whoever reads the outputs renders from their ids with an OutputText of its own (process.py)."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: tuple[str, ...], eos_ids: frozenset[int],
                 render: bool = True):
        self.render = render or bool(stops)  # stop strings are found in the text, so it is made here
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids) if self.render else None
        self.stops = StopStrings(stops)
        self.eos_ids = eos_ids

    def is_stop_token(self, token: int, stop_token_ids: tuple[int, ...], ignore_eos: bool) -> bool:
        return (token in self.eos_ids and not ignore_eos) or token in stop_token_ids

    def add(self, token: int, stop_token_ids: tuple[int, ...], ignore_eos: bool, at_limit: bool) -> tuple[str, str | None]:
        """The text to send after `token` and the finish reason, if it ended the request."""
        finish = None
        if self.is_stop_token(token, stop_token_ids, ignore_eos):
            finish, text = "stop", ""
        else:
            text = self.stops.add(self.detokenizer.add(token))
            if self.stops.stopped:
                finish = "stop"
            elif at_limit:
                finish = "length"
        if finish is not None and not self.stops.stopped:
            text += self.stops.add(self.detokenizer.flush()) + self.stops.flush()
        return text, finish

    def add_all(self, tokens: list[int], stop_token_ids: tuple[int, ...], ignore_eos: bool,
                at_limit: bool) -> tuple[str, str | None, int]:
        """add() of each token, `at_limit` said of the last: the text, the finish reason and how
        many of the tokens count (a stop string drops those after it). Only the last can be a stop
        id or EOS (the engine ends a sequence there), so without stop strings the others go
        straight to the detokenizer."""
        if not self.render:  # only the last can end it, as below
            if self.is_stop_token(tokens[-1], stop_token_ids, ignore_eos):
                return "", "stop", len(tokens)
            return "", "length" if at_limit else None, len(tokens)
        texts, start = [], 0
        if not self.stops.stops:
            add = self.detokenizer.add
            texts = [add(token) for token in tokens[:-1]]
            start = len(tokens) - 1
        for index in range(start, len(tokens)):
            text, finish = self.add(tokens[index], stop_token_ids, ignore_eos, at_limit and index == len(tokens) - 1)
            texts.append(text)
            if finish is not None:
                return "".join(texts), finish, index + 1
        return "".join(texts), None, len(tokens)

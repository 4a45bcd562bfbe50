"""Structured output through xgrammar: constraints compiled for one tokenizer (cached by content),
a matcher per request, and the matchers' token bitmasks applied to a step's logits in one call.

xgrammar (vLLM's and SGLang's default backend) rather than llguidance: it fills a request's mask in
microseconds from its precomputed per-state token sets, and applies masks for a whole batch with a
CPU kernel or a CUDA/Triton one; it is already in vLLM's dependency tree.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from worker.errors import InvalidRequest
from worker.request import Constraint

# xgrammar's messages start with a time and its C++ source location.
LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


class Grammars:
    """Compiles a request's constraint for this tokenizer and makes the matchers that follow it.

    JSON comes out compact (`{"a": 1, "b": [2, 3]}`, no newlines or runs of spaces): free
    whitespace lets a small model sampled at temperature 1 spend its tokens on blanks.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_ids))
        # Its cache keys on the constraint's text: a repeated schema compiles once.
        threads = min(8, len(os.sched_getaffinity(0)))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        # Fills a step's masks in C++, split over threads: half the cores, the rest left to the step.
        self._filler = xgr.BatchGrammarMatcher(max_threads=max(1, threads // 2))
        self._bitmask: torch.Tensor | None = None
        # A copy: the property converts the whole vocabulary from C++ on every read (~0.1 s).
        self._vocab: list[bytes] = self.info.decoded_vocab

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar; InvalidRequest with the compiler's message when it is malformed."""
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind == "json_schema":
                _check_schema(spec)
                return self.compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "grammar":
                return self.compiler.compile_grammar(spec)
            return self.compiler.compile_grammar(choice_grammar(spec))
        except InvalidRequest:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the reason
            message = LOCATION.sub("", str(exc).strip()).splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequest(f"structured_output.{kind}: {message}") from None

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    @staticmethod
    def serialize(compiled: Any) -> str:
        """For an engine in its own process (xgrammar's grammars do not pickle): ~2 ms, 54 kB for a
        two-property schema with SmolLM2's tokenizer."""
        return compiled.serialize_json()

    def deserialize(self, text: str) -> Any:
        return self._xgr.CompiledGrammar.deserialize_json(text, self.info)

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Sets to -inf, in place, the logits of tokens each row's grammar does not allow next. Rows
        without a matcher are left alone; an ended grammar allows only its stop tokens."""
        batch = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = self._xgr.allocate_token_bitmask(max(batch, 8), self.vocab_size)
            if logits.is_cuda:  # pinned: the copy below is queued, not waited for
                self._bitmask = self._bitmask.pin_memory()
        bitmask = self._bitmask[:batch]
        every = len(rows) == batch  # then no index list to build and copy to the device
        # The step's tokens are read before the next one fills it: no copy from it is still pending.
        self._filler.batch_fill_next_token_bitmask(matchers, bitmask, None if every else rows)
        if logits.is_cuda:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=None if every else rows)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (byte-level and byte-fallback vocabularies decoded)."""
        return self._vocab[token_id] if 0 <= token_id < len(self._vocab) else b""


def choice_grammar(spec: str) -> str:
    """The EBNF grammar of a choice constraint (its spec a JSON array of strings)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec))


def _check_schema(spec: str) -> None:
    """JSON Schema's own check first: its message names the keyword and path at fault."""
    import jsonschema

    schema = json.loads(spec)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        raise InvalidRequest(f"structured_output.json_schema: {exc.message}" + (f" (at {path})" if path else "")) from None

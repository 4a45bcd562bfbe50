"""Retrieval-augmented prompts: the top passages of a local knowledge base for the question, put
before the prompt (or into the chat's system message) within a token budget."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from worker.adapters.base import Adapter, AdapterError, AdapterInputError, TokenCounter, reject_unknown, require
from worker.adapters.knowledge_base import KnowledgeBase, KnowledgeBaseError
from worker.request import ChatMessage, GenerationRequest

INSTRUCTION = "Answer using the context below when it is relevant."


class RagAdapter(Adapter):
    kind = "rag"

    def __init__(self, name: str, kb: KnowledgeBase, top_k: int, max_context_tokens: int):
        super().__init__(name)
        self.kb = kb
        self.top_k = top_k
        self.max_context_tokens = max_context_tokens

    @classmethod
    def from_options(cls, name: str, options: dict[str, Any], kb_dir: Path) -> RagAdapter:
        options = dict(options)
        kb = require(options, "kb", str)
        top_k = require(options, "top_k", int, 3, 1, 50)
        budget = require(options, "max_context_tokens", int, 512, 16, 1_000_000)
        reject_unknown(options, "kb, top_k, max_context_tokens")
        path = Path(kb) if "/" in kb else kb_dir / f"{kb}.sqlite"
        return cls(name, KnowledgeBase(path), top_k, budget)

    def prepare_prompt(self, request: GenerationRequest, count_tokens: TokenCounter) -> GenerationRequest:
        if request.prompt is not None:
            question = request.prompt
        elif request.messages:
            users = [m.content for m in request.messages if m.role == "user"]
            question = users[-1] if users else request.messages[-1].content
        else:
            raise AdapterInputError(f"adapter {self.name!r} retrieves by text; send a prompt or messages, not token ids")
        try:
            passages = self.kb.search(question, self.top_k)
        except KnowledgeBaseError as exc:
            raise AdapterError(f"adapter {self.name!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a broken index file fails this request, not the worker
            raise AdapterError(f"adapter {self.name!r}: knowledge base unreadable ({type(exc).__name__})") from None
        context, used = [], 0
        for passage in passages:
            block = f"[{passage.source}]\n{passage.text}"
            cost = count_tokens(block)
            if used + cost > self.max_context_tokens:
                continue  # a shorter, lower-ranked passage may still fit
            context.append(block)
            used += cost
        if not context:
            return request
        text = INSTRUCTION + "\n\n" + "\n\n".join(context)
        if request.prompt is not None:
            return dataclasses.replace(request, prompt=f"Context:\n{text}\n\nQuestion: {request.prompt}\n")
        messages = list(request.messages)
        if messages[0].role == "system":
            messages[0] = ChatMessage("system", f"{messages[0].content}\n\n{text}")
        else:
            messages.insert(0, ChatMessage("system", text))
        return dataclasses.replace(request, messages=tuple(messages))

    def close(self) -> None:
        self.kb.close()

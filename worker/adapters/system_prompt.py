"""A fixed system prompt for every request through the adapter: prepended to a chat, or to a
plain prompt through a template with a {prompt} slot."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from worker.adapters.base import Adapter, AdapterInputError, TokenCounter, reject_unknown, require
from worker.request import ChatMessage, GenerationRequest


class SystemPromptAdapter(Adapter):
    kind = "system_prompt"

    def __init__(self, name: str, text: str, template: str, replace: bool):
        super().__init__(name)
        self.text = text
        self.template = template
        self.replace = replace

    @classmethod
    def from_options(cls, name: str, options: dict[str, Any], kb_dir: Path) -> SystemPromptAdapter:
        options = dict(options)
        text = require(options, "text", str)
        template = require(options, "template", str, "{system}\n\n{prompt}")
        replace = require(options, "replace", bool, False)
        reject_unknown(options, "text, template, replace")
        if "{prompt}" not in template:
            raise ValueError("template: must hold {prompt}")
        try:
            template.format(system="", prompt="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"template: only {{system}} and {{prompt}} may appear ({exc})") from None
        return cls(name, text, template, replace)

    def prepare_prompt(self, request: GenerationRequest, count_tokens: TokenCounter) -> GenerationRequest:
        if request.prompt is not None:
            return dataclasses.replace(request, prompt=self.template.format(system=self.text, prompt=request.prompt))
        if not request.messages:
            raise AdapterInputError(f"adapter {self.name!r} needs a prompt or messages, not token ids")
        messages = list(request.messages)
        if messages[0].role == "system":
            content = self.text if self.replace else f"{self.text}\n\n{messages[0].content}"
            messages[0] = ChatMessage("system", content)
        else:
            messages.insert(0, ChatMessage("system", self.text))
        return dataclasses.replace(request, messages=tuple(messages))

"""Prompts to token ids with a Hugging Face tokenizer: text as is, chats through the model's template."""

from __future__ import annotations

from typing import Any

from worker.errors import InvalidRequest
from worker.request import GenerationRequest


def encode_prompt(tokenizer: Any, request: GenerationRequest) -> list[int]:
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    if request.messages is not None:
        if not tokenizer.chat_template:
            raise InvalidRequest("this model has no chat template; send a prompt instead")
        rendered = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in request.messages],
            add_generation_prompt=True, tokenize=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer(request.prompt)["input_ids"]

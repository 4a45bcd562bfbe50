"""A model's Hugging Face tokenizer, and prompts to token ids with it: text as is, chats through the
model's template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker.errors import InvalidRequest
from worker.request import GenerationRequest

GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer. Where its config names the generic fast class, that class straight
    from tokenizer.json: AutoTokenizer reads the model's config first, and with transformers 5 that
    import chain pulls in torch._dynamo (1.5 s on 2 cores; the native engine is ready in 1.3 s without it)."""
    config = folder / "tokenizer_config.json"
    if (folder / "tokenizer.json").exists() and config.exists() and \
            json.loads(config.read_text()).get("tokenizer_class") in GENERIC_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


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

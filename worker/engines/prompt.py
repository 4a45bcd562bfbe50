"""A model's Hugging Face tokenizer, and prompts to token ids with it: text as is, chats through the
model's template."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

from worker.errors import InvalidRequest
from worker.request import GenerationRequest

GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}
# Texts on which a tokenizer's Rust backend must give what its Python __call__ gives before it is
# called alone: spaces, accents, CJK, an emoji, control characters, digits.
PROBES = ("Hello world", " leading space", "naïve café, 日本語 🙂", "a\nb\tc  d\r\n", "x=1234.5;")
_agrees: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> backend_agrees


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
        messages = [m.template_dict() for m in request.messages]
        extra = {}
        if renders_tools(tokenizer):
            extra["tools"] = request.tools
        else:
            messages = _tools_in_messages(messages, request.tools)
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        return encode_text(tokenizer, rendered, False)
    return encode_text(tokenizer, request.prompt, True)


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """The tokenizer's ids for `text`: through its Rust backend where that gives what __call__ gives
    (backend_agrees), skipping __call__'s Python around it (30 against 12 us an 8-word prompt:
    tokenizing was a tenth of the event loop's work a request under load)."""
    if backend_agrees(tokenizer):
        return tokenizer.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def backend_agrees(tokenizer: Any) -> bool:
    """Whether a fast tokenizer's backend gives __call__'s ids on PROBES and the special tokens' text,
    with and without special tokens (a tokenizer whose Python adds something of its own does not);
    found once a tokenizer."""
    try:
        return _agrees[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: no cache, so __call__ every time
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    probes = [*PROBES, "".join(str(t) for t in getattr(tokenizer, "all_special_tokens", ())) + " after"]
    agrees = _agrees[tokenizer] = backend is not None and all(
        backend.encode(text, add_special_tokens=special).ids == tokenizer(text, add_special_tokens=special)["input_ids"]
        for text in probes for special in (True, False))
    return agrees


def renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template shows tool definitions and calls itself."""
    return "tools" in (tokenizer.chat_template or "") and "tool_calls" in (tokenizer.chat_template or "")


def _tools_in_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template that knows nothing of tools: the definitions go into the system message and
    earlier calls into the assistant's text, in the Hermes format (<tools>, <tool_call>) that many
    open models were trained on, so the model still sees them."""
    out = []
    for message in messages:
        calls = message.pop("tool_calls", None)
        if calls:
            rendered = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                                 "arguments": c["function"]["arguments"]})
                                  + "\n</tool_call>" for c in calls)
            message["content"] = "\n".join(filter(None, [message["content"], rendered]))
        if message["role"] == "tool":
            message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
        message.pop("tool_call_id", None)
        message.pop("name", None)
        out.append(message)
    if tools:
        listing = "\n".join(json.dumps(tool["function"]) for tool in tools)
        preamble = (f"You may call one or more functions to assist with the user query. The functions:\n"
                    f"<tools>\n{listing}\n</tools>\nFor each call, return a JSON object with the function name "
                    f"and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
                    f'{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out

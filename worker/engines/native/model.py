"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2's qkv bias) in plain PyTorch, over a paged KV cache.

A forward pass takes the tokens of several sequences packed into one row (prefill chunks and decode
tokens alike) and, per sequence, where its tokens go in the cache and which cached blocks it reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        raw = json.loads((folder / "config.json").read_text())
        architecture = (raw.get("architectures") or [raw.get("model_type", "?")])[0]
        if architecture not in SUPPORTED and raw.get("model_type") not in {"llama", "mistral", "qwen2"}:
            raise ValueError(f"the native engine runs {', '.join(sorted(SUPPORTED))}; {folder} is {architecture}")
        # transformers 5 writes rope_parameters; older folders rope_theta (+ rope_scaling).
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if (rope.get("rope_type") or rope.get("type") or "default") != "default":
            raise ValueError(f"rope type {rope.get('rope_type') or rope.get('type')!r} is not supported by the native engine yet")
        eos = raw.get("eos_token_id")
        generation = folder / "generation_config.json"
        if generation.exists():
            eos = json.loads(generation.read_text()).get("eos_token_id", eos)
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"], num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta") or rope.get("rope_theta", 10000.0), max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=raw.get("model_type") == "qwen2" or raw.get("attention_bias", False),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )


@dataclass
class Batch:
    """One step's packed tokens. T tokens in all, from S sequences."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    slots: torch.Tensor  # (T,) flat cache slot (block * block_size + offset) each token's K/V goes to
    query_lens: list[int]  # per sequence: tokens in this step
    context_lens: list[int]  # per sequence: tokens in the cache after this step
    block_tables: list[list[int]]  # per sequence: its blocks, in order
    last_token_index: torch.Tensor  # (S,) index into T of each sequence's last token
    block_size: int
    context_slots: list[torch.Tensor] | None = None  # per sequence: (context_len,) cache slots, in order
    masks: list[torch.Tensor | None] | None = None  # per sequence: (query_len, context_len) causal mask

    def prepare(self) -> Batch:
        """Per-step index work, done once here rather than in every layer."""
        device = self.input_ids.device
        offsets = torch.arange(self.block_size, device=device)
        self.context_slots, self.masks = [], []
        for query_len, context_len, blocks in zip(self.query_lens, self.context_lens, self.block_tables):
            table = torch.tensor(blocks, device=device)
            self.context_slots.append((table[:, None] * self.block_size + offsets[None, :]).reshape(-1)[:context_len])
            if query_len == 1:
                self.masks.append(None)  # a decode token sees its whole context
            else:
                # Query i sits at context position context_len - query_len + i and sees up to it.
                self.masks.append(torch.arange(context_len, device=device)[None, :]
                                  <= (context_len - query_len + torch.arange(query_len, device=device))[:, None])
        return self


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's rotate_half layout. x (T, H, D); cos, sin (T, 1, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q = rotate(self.q_proj(x).view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        # k_cache, v_cache: (num_blocks * block_size, kv_heads, head_dim), written slot by slot.
        k_cache.index_copy_(0, batch.slots, k)
        v_cache.index_copy_(0, batch.slots, v)
        return self.o_proj(paged_attention(q, batch, k_cache, v_cache, self.num_kv_heads).reshape(tokens, -1))


def paged_attention(q: torch.Tensor, batch: Batch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    num_kv_heads: int) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context. q (T, H, D) -> (T, H, D)."""
    out = torch.empty_like(q)
    start = 0
    for query_len, slots, mask in zip(batch.query_lens, batch.context_slots, batch.masks):
        k = k_cache[slots].transpose(0, 1)  # (kv_heads, C, D)
        v = v_cache[slots].transpose(0, 1)
        qs = q[start:start + query_len].transpose(0, 1)  # (H, Q, D)
        out[start:start + query_len] = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=mask, enable_gqa=True).transpose(0, 1)
        start += query_len
    return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, batch, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.inference_mode()
    def forward(self, batch: Batch, k_caches: torch.Tensor, v_caches: torch.Tensor) -> torch.Tensor:
        """Logits of each sequence's last token: (S, vocab)."""
        if batch.context_slots is None:
            batch.prepare()
        x = self.embed_tokens(batch.input_ids)
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, k_caches[index], v_caches[index])
        return self.lm_head(self.norm(x[batch.last_token_index])).float()


def load_model(folder: Path, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """Weights from the folder's safetensors files (any dtype), cast to `dtype` on `device`."""
    from safetensors.torch import load_file

    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaModel(config)
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update({k.removeprefix("model."): v for k, v in load_file(path).items()})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = set(dict(model.named_parameters())) - set(state) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"{folder}: weights missing for {sorted(missing)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
    return model.to(device).eval()

"""Llama-family decoder (Llama 2/3 and 3.1's rope scaling, SmolLM2, Mistral, Qwen2's qkv bias) in plain PyTorch,
over a paged KV cache.

A forward pass takes the tokens of several sequences packed into one row (prefill chunks and decode
tokens alike) and, per sequence, where its tokens go in the cache and which cached blocks it reads.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from worker.engines.native import kernels
from worker.engines.native.attention import decode_attention, prefill_attention, rope_store_and_decode
from worker.engines.native.batch import Batch
from worker.engines.native.elementwise import Elementwise
from worker.engines.native.gemv import triton
from worker.engines.native.linear import PackedLinear, Parts, QuantLinear, RowLinear, Sum
from worker.engines.native.rotary import Rope, rope_and_store

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
ROPE_SCALING = {"default": (), "linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
"""The rotary embedding's types the model runs (Llama 3.1 and later use llama3), and what each reads."""


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
    rope_type: str
    rope_scaling: tuple[tuple[str, float], ...]  # ROPE_SCALING[rope_type]'s keys and their values
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        raw = json.loads((folder / "config.json").read_text())
        architecture = (raw.get("architectures") or [raw.get("model_type", "?")])[0]
        if architecture not in SUPPORTED and raw.get("model_type") not in {"llama", "mistral", "qwen2"}:
            raise ValueError(f"the native engine runs {', '.join(sorted(SUPPORTED))}; {folder} is {architecture}")
        # transformers 5 writes rope_parameters; older folders rope_theta (+ rope_scaling).
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ROPE_SCALING or rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"rope type {rope_type!r} (partial_rotary_factor {rope.get('partial_rotary_factor', 1.0)}) is not "
                             f"supported by the native engine; it runs {', '.join(ROPE_SCALING)} on every dimension")
        if any(key not in rope for key in ROPE_SCALING[rope_type]):
            raise ValueError(f"rope type {rope_type!r} needs {', '.join(ROPE_SCALING[rope_type])}; {folder} has {sorted(rope)}")
        eos = raw.get("eos_token_id")
        generation = folder / "generation_config.json"
        if generation.exists():
            eos = json.loads(generation.read_text()).get("eos_token_id", eos)
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"], num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta") or rope.get("rope_theta", 10000.0), rope_type=rope_type,
            rope_scaling=tuple((key, float(rope[key])) for key in ROPE_SCALING[rope_type]),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2: biases on q, k and v only; Llama's attention_bias puts one on o too.
            qkv_bias=raw.get("model_type") == "qwen2" or raw.get("attention_bias", False),
            o_bias=raw.get("model_type") != "qwen2" and raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Elementwise):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor | Parts, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm); Parts: x's parts added up in the norm's kernel (Triton's)."""
        return self.ops.add_rms_norm(x.parts if isinstance(x, Parts) else x, residual, self.weight, self.eps)

    def then(self, linear: nn.Module, x: torch.Tensor | Sum | Parts, residual: torch.Tensor | None,
             rope: Rope | None = None, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, linear(its norm)): the residual stream and the next sublayer's projection
        (residual None: x itself, or a Sum, the stream as the kernel before gave it). One row on CUDA
        takes one kernel (RowLinear.after_add_rms_norm); so does a Sum where few_rows takes its rows
        (RowLinear.after_norm); Parts, as plus() gives them, are added up by the norm's kernel. rope
        (Attention.rope_inside): the projection's kernel rotates and writes the cache too; gated: a
        gate/up projection, silu(gate) * up in its place (inside its kernel on CUDA)."""
        if isinstance(x, Sum):
            fused = (linear.after_norm(x, self.eps, self.ops.silu_and_mul if gated else None)
                     if x.norm is self.weight else None)
            if fused is not None:
                return x.total, fused
            x = x.total
        elif residual is not None and isinstance(linear, RowLinear) and not isinstance(x, Parts):
            fused = linear.after_add_rms_norm(x, residual, self.weight, self.eps, rope, gated)
            if fused is not None:
                return fused
        residual, h = (x, self(x)) if residual is None else self.add(x, residual)
        if rope is not None:
            return residual, linear.rotating(h, rope)
        if gated:
            return residual, (linear.activated(h, self.ops.silu_and_mul) if isinstance(linear, RowLinear)
                              else self.ops.silu_and_mul(linear(h)))
        return residual, linear(h)


def plus(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
         next_norm: RMSNorm | None) -> tuple[torch.Tensor | Sum | Parts, torch.Tensor | None]:
    """(linear(x) + residual as a Sum, None) where the product's kernel adds the residual stream
    (RowLinear.adding, at 2-32 rows on CUDA: few_rows.HANDOFF_MOST_ROWS), with what lets the
    projection after `next_norm` take it without that norm's kernel; else (linear(x), residual),
    for the norm after it to add, linear(x) as Parts where it runs split along K (RowLinear.split)."""
    if residual is not None and isinstance(linear, RowLinear):
        summed = linear.adding(x, residual, next_norm.weight if next_norm is not None else None)
        if summed is not None:
            return summed, None
        split = linear.split(x, residual)
        if split is not None:
            return split, residual
    return linear(x), residual


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Elementwise):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        # q, k and v projections as one matrix (one GEMM a layer instead of three); see load_model.
        self.sizes = [config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                      config.num_kv_heads * config.head_dim]
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_bias)

    def rope_inside(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch,
                    k_cache: torch.Tensor, v_cache: torch.Tensor) -> Rope | None:
        """What the qkv projection's kernel needs to rotate q and k and write k and v itself, where it
        can: one row, a decode (a kernel fewer a layer at batch 1); else None."""
        if (not isinstance(self.qkv_proj, RowLinear) or batch.distinct or batch.prefills or batch.fresh
                or not self.qkv_proj.takes_rope(x, self.head_dim)):
            return None
        return Rope(cos, sin, batch.slots, k_cache, v_cache, self.sizes[0], self.sizes[1])

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm,
                rotated: bool = False) -> tuple[torch.Tensor | Sum, torch.Tensor | None]:
        """The layer's attention output from its qkv projection (DecoderLayer runs qkv_proj with the
        norm), as plus() gives it with the residual stream and `next_norm`; rotated: q and k were
        rotated and k and v written by it (rope_inside)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k, v = (x.reshape(tokens, self.num_kv_heads, self.head_dim) for x in (k, v))
        if batch.distinct:  # each row its own sequence's token (CUDA graphs): rotated and written inside attention
            out = rope_store_and_decode(q, k, v, cos, sin, k_cache, v_cache, batch.slots, batch.decode_tables,
                                        batch.decode_lens, batch.block_size, batch.long_contexts)
            return plus(self.o_proj, out.reshape(tokens, -1), residual, next_norm)
        if not rotated:  # (else a decode, its rotation and cache write done by rope_inside's kernel)
            # k_cache, v_cache: (num_blocks * block_size, kv_heads, head_dim), written slot by slot.
            q, k = rope_and_store(q, k, v, cos, sin, k_cache, v_cache, batch.slots, self.ops.rotate)
        if not batch.prefills and not batch.fresh:  # every token a decode: the common step, and the CUDA graph's
            out = decode_attention(q, k_cache, v_cache, batch.decode_tables, batch.decode_lens, batch.block_size,
                                   batch.decode_gather, batch.long_contexts)
        else:
            out = prefill_attention(q, k, v, k_cache, v_cache, batch.fresh, batch.prefills, batch.paged_prefills,
                                    batch.block_size)
            if batch.decode_tables is not None:
                out[batch.decode_index] = decode_attention(q[batch.decode_index], k_cache, v_cache, batch.decode_tables,
                                                           batch.decode_lens, batch.block_size, batch.decode_gather,
                                                           batch.long_contexts)
        return plus(self.o_proj, out.reshape(tokens, -1), residual, next_norm)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Elementwise):
        super().__init__()
        self.self_attn = Attention(config, ops)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, x, residual, cos, sin, batch, k_cache, v_cache, next_norm: RMSNorm | None = None):
        """(this layer's MLP output, the residual stream before it): the next layer's norm adds them
        in the same kernel (the first layer's gets residual None); or (their sum, None) where the
        down projection's kernel adds them (plus(), with `next_norm`, the next layer's first norm)."""
        # (a Sum or Parts has several rows: never one-row rope inside the qkv projection)
        rope = None if isinstance(x, (Sum, Parts)) else self.self_attn.rope_inside(x, cos, sin, batch, k_cache, v_cache)
        residual, qkv = self.input_layernorm.then(self.self_attn.qkv_proj, x, residual, rope)
        attended, residual = self.self_attn(qkv, cos, sin, batch, k_cache, v_cache, residual,
                                            self.post_attention_layernorm, rotated=rope is not None)
        residual, activation = self.post_attention_layernorm.then(self.mlp.gate_up_proj, attended, residual, gated=True)
        return plus(self.mlp.down_proj, activation, residual, next_norm)


class MLP(nn.Module):
    """Its projections; DecoderLayer runs them, gate_up_proj with the norm before it and the
    activation after it (RMSNorm.then)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.ops = Elementwise()
        # _weight: no random init (on meta, nn.Embedding's normal_ imports torch._dynamo: 1.2-2 s of startup).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, self.ops) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotations: torch.Tensor | None = None  # set by cache_rotations()
        self.decode_weights: kernels.LayerWeights | None = None  # set by gather_decode_weights()

    @torch.inference_mode()
    def forward(self, batch: Batch, k_caches: torch.Tensor, v_caches: torch.Tensor) -> torch.Tensor:
        """Logits of each sequence's last token: (S, vocab), in the model's dtype (the sampler upcasts
        what it must; at batch 256 a float copy here was 4% of a decode step)."""
        if batch.prefills is None:
            batch.prepare(self.config.head_dim, self.config.num_kv_heads)
        x, cos, sin = self.ops.embed(batch.input_ids, batch.positions, self.embed_tokens.weight, self.rotations)
        if self.decode_weights is not None and not batch.prefills and not batch.fresh:
            x, residual = kernels.decode_layers(x, self.decode_weights, k_caches, v_caches, cos, sin, batch.slots,
                                                batch.decode_tables, batch.decode_lens, batch.block_size)
        else:
            residual = None
            for index, layer in enumerate(self.layers):
                after = self.layers[index + 1].input_layernorm if index + 1 < len(self.layers) else None
                x, residual = layer(x, residual, cos, sin, batch, k_caches[index], v_caches[index], after)
        if isinstance(x, Sum):  # the last down projection's kernel added the stream
            x, residual = x.total, None
        if len(batch.last_token_index) < len(batch.input_ids):  # else every token is a decode, its sequence's last
            x = x.rows(batch.last_token_index) if isinstance(x, Parts) else x[batch.last_token_index]
            residual = residual[batch.last_token_index] if residual is not None else None
        # The norm's own kernel: inside one row's LM head kernel its 16k programs would each read the
        # whole row; inside few_rows' (few_rows.HANDOFF_MOST_ROWS) it was the slower.
        return self.lm_head(self.norm(x) if residual is None else self.norm.add(x, residual)[1])

    def cache_rotations(self, positions: int) -> None:
        """cos and sin of every position below `positions`, (2, positions, D) in the model's dtype, as HF
        computes them (fp32 on the model's device, then rounded): a step takes its rows in one kernel, not seven."""
        device = self.embed_tokens.weight.device
        inv_freq = rope_frequencies(self.config).to(device)  # on the CPU first, as HF computes it
        freqs = torch.arange(positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotations = torch.stack((emb.cos(), emb.sin())).to(self.embed_tokens.weight.dtype)

    def gather_decode_weights(self) -> None:
        """On CPUs with the kernels built and every linear layer laid out by linear.py: all-decode
        steps run the decoder layers in one C++ call (kernels.decode_layers)."""
        flat = [linear for layer in self.layers for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not kernels.loaded() or not all(isinstance(linear, (PackedLinear, QuantLinear)) for linear in flat):
            return
        self.decode_weights = kernels.LayerWeights(
            norms=[norm.weight for layer in self.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)],
            weights=[linear.packed for linear in flat],
            scales=[linear.scales if isinstance(linear, QuantLinear) else None for linear in flat],
            biases=[linear.bias for linear in flat], heads=self.config.num_heads, eps=self.config.rms_norm_eps)

    def weight_bytes(self) -> int:
        packed = {id(m.packed): m.weight_bytes for m in self.modules() if hasattr(m, "packed")}
        return sum(p.numel() * p.element_size() for p in self.parameters()) + sum(packed.values())


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """The rotary embedding's inverse frequencies, (D / 2,), as HF computes them for the model's rope type."""
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, device="cpu").float() / config.head_dim)
    scaling = dict(config.rope_scaling)
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if config.rope_type == "llama3":  # long wavelengths slowed by `factor`, short ones kept, a blend between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < context / high) * ~(wavelength > context / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


def wrap_linears(root: nn.Module, wrapper) -> None:
    """Every plain nn.Linear under `root` (a tied lm_head too, as its own copy) replaced by
    wrapper(layer), which may return the layer as it is; layers already wrapped are left alone."""
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, wrapper(child))


def merge_projections(state: dict[str, torch.Tensor], num_layers: int) -> None:
    """HF keeps q/k/v and gate/up as separate matrices; this model stacks each group into one."""
    groups = [("self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj"), ("mlp.", ("gate_proj", "up_proj"), "gate_up_proj")]
    for layer in range(num_layers):
        for module, parts, merged in groups:
            for kind in ("weight", "bias"):
                keys = [f"layers.{layer}.{module}{part}.{kind}" for part in parts]
                if all(key in state for key in keys):
                    state[f"layers.{layer}.{module}{merged}.{kind}"] = torch.cat([state.pop(key) for key in keys])


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, quantization: str = "none",
               max_positions: int = 0) -> LlamaModel:
    """Weights from the folder's safetensors files (any dtype), cast to `dtype` on `device`;
    quantization "int4": the linear layers' weights in 4 bits (CPU, bf16). Positions run up to
    `max_positions` (0: the model's max_position_embeddings)."""
    from safetensors.torch import load_file

    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaModel(config)
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        if not os.access(path, os.R_OK):  # safetensors reports this as "No such file or directory"
            raise PermissionError(f"{path}: not readable by uid {os.getuid()} (mode {path.stat().st_mode & 0o777:o})")
        state.update({k.removeprefix("model."): v for k, v in load_file(path).items()})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    merge_projections(state, config.num_layers)
    expected = set(dict(model.named_parameters()))
    missing = expected - set(state) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"{folder}: weights missing for {sorted(missing)[:5]}")
    # A weight this model has no place for is a variant it does not implement: refused, not dropped.
    unused = {key for key in state if key not in expected and not key.endswith("rotary_emb.inv_freq")}
    if unused:
        raise ValueError(f"{folder}: the native engine has no place for the weights {sorted(unused)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device).eval()
    model.cache_rotations(max_positions or config.max_position_embeddings)
    if device.type == "cpu" and kernels.loaded():
        model.ops.use_cpu_kernels()
    if device.type == "cuda" and triton is not None:
        model.ops.use_triton()
        wrap_linears(model, RowLinear)
    if device.type == "cpu" and quantization == "int4":
        # The decoder layers in 4 bits, the output layer in 8, as llama.cpp's 4-bit files keep theirs
        # in 6 or 8: the embedded model's (tied to its Q8_0 embedding) lost 9% of its norm in 4 bits,
        # and with it the answer to the France question.
        wrap_linears(model.layers, lambda linear: QuantLinear(linear, 4) if QuantLinear.fits(linear) else linear)
        wrap_linears(model, lambda linear: QuantLinear(linear, 8) if QuantLinear.fits(linear) else linear)
    if device.type == "cpu":
        wrap_linears(model, lambda linear: PackedLinear(linear) if PackedLinear.fits(linear) else linear)
    if device.type == "cpu":
        model.gather_decode_weights()
    return model

"""Llama-family decoder (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) over
packed tokens, and the same decoder with a classification head (their *ForSequenceClassification).

The numerics follow `transformers` op for op (RMSNorm in float32, RoPE tables computed in float32
by transformers' own rope functions, SwiGLU), so greedy outputs match it exactly. Differences from
the HF modules: q/k/v and gate/up projections are fused into one matmul each, a step's tokens are
packed into one [num_tokens, hidden] batch, and attention reads and writes the paged KV cache.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels
from ..context_length import (CLASSIFIER, architecture, causal_architecture, context_length, longest_context,
                              rope_scaling)
from ..attention import AttentionBackend, AttentionMetadata

log = logging.getLogger("inflight")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ARCHITECTURES += tuple(name.replace("ForCausalLM", CLASSIFIER) for name in SUPPORTED_ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """The few numbers and switches that distinguish one Llama-family checkpoint from another."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    context_length: int          # the default max_model_len (context_length.py)
    longest_context: int         # the longest max_model_len it supports
    qk_norm: bool = False        # Qwen3: each query and key head RMS-normed before RoPE
    num_labels: int | None = None    # a *ForSequenceClassification: its score head's outputs (no LM head)

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        arch = architecture(config)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
        classifier = arch.endswith(CLASSIFIER)
        arch = causal_architecture(arch)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is supported")
        rope_type, _ = rope_scaling(config)         # here, before any weight is read
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)) and not classifier,
            context_length=context_length(config),
            longest_context=longest_context(config),
            qk_norm=arch == "Qwen3ForCausalLM",
            num_labels=config.num_labels if classifier else None,
        )


def rope_tables(config, max_positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, head_dim] for every position, computed exactly as transformers
    does per forward (float32, then cast), using its rope-type functions for the frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_type, _ = rope_scaling(config)       # one ModelSpec.from_hf_config took
    init = LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default" \
        else ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init(config)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(device=device, dtype=dtype), (emb.sin() * scaling).to(device=device, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_kernels.for_tensor(x)      # one compiled call on CPU, same rounding
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the decoder's skip connection and the next norm in one
        pass (on CPU one compiled call, the sum written into `residual`)."""
        fused = cpu_kernels.for_tensor(x)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self.forward(residual), residual


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    fused = cpu_kernels.for_tensor(x)          # one compiled call on CPU, same rounding
    if fused is not None:
        return fused.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [tokens, 2 * intermediate] (one compiled call on CPU)."""
    fused = cpu_kernels.for_tensor(gate_up)
    if fused is not None:
        return fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache, backend: AttentionBackend, lora=None):
        qkv = self.qkv_proj(x)
        if lora is not None:        # adapters' q/k/v terms, each into its columns of the fused output
            lora.add("qkv", x, qkv)
        if self.qk_norm:
            self.norm_qk(qkv)
        real = meta.num_real_tokens     # padding rows (static/dynamic policies) skip attention
        if backend.rotary_write_kv is not None:
            q = backend.rotary_write_kv(qkv, self.num_heads, self.num_kv_heads, cos, sin, k_cache, v_cache,
                                        meta.slot_mapping)
        else:
            q, k = self.rotate_qk(qkv, cos, sin)
            v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
            if real:
                backend.write_kv(k[:real], v[:real], k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)       # attention writes every real row
        if real < len(out):
            out[real:].zero_()
        if real:
            backend.attention(q[:real], k_cache, v_cache, out[:real], meta, self.scale)
        out = out.view(-1, self.q_size)
        o = self.o_proj(out)
        if lora is not None:
            lora.add("o", out, o)
        return o

    def norm_qk(self, qkv: torch.Tensor) -> None:
        """Qwen3's: each query and key head RMS-normed, with weights of their own, in place in qkv
        (where every attention backend then reads them, as from any other model)."""
        tokens, q_end, k_end = qkv.shape[0], self.q_size, self.q_size + self.kv_size
        q = qkv[:, :q_end].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(tokens, self.num_kv_heads, self.head_dim)
        qkv[:, :q_end] = self.q_norm(q).view(tokens, self.q_size)
        qkv[:, q_end:k_end] = self.k_norm(k).view(tokens, self.kv_size)

    def rotate_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated. On CPU one compiled call for both (they sit side by side in qkv);
        elsewhere each into a contiguous tensor of its own, the layout the CUDA kernels are
        compiled ahead for."""
        if cpu_kernels.for_tensor(qkv) is not None:
            heads = self.num_heads + self.num_kv_heads
            qk = rotate(qkv[:, :heads * self.head_dim].view(-1, heads, self.head_dim), cos, sin)
            return qk[:, :self.num_heads], qk[:, self.num_heads:]
        q = qkv[:, :self.q_size].view(-1, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
        return rotate(q, cos, sin), rotate(k, cos, sin)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.add("gate_up", x, gate_up)
        act = silu_and_mul(gate_up)
        down = self.down_proj(act)
        if lora is not None:
            lora.add("down", act, down)
        return down


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, residual, cos, sin, meta, k_cache, v_cache, backend, lora=None):
        """x: the previous layer's output, still to be added to the residual stream (None in the
        first layer, whose x is the stream) -> (this layer's output, the stream)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, meta, k_cache, v_cache, backend, lora)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec)
        self.add_head()

    def add_head(self) -> None:
        self.lm_head = nn.Linear(self.spec.hidden_size, self.spec.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """A tied config's LM head is the embedding matrix itself."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
                lora=None) -> torch.Tensor:
        """input_ids [num_tokens], cos/sin [num_tokens, head_dim] -> hidden states [num_tokens, hidden].
        lora: the step's LoraBatch (inflight.lora) when some token runs with an adapter."""
        x, residual = self.model.embed_tokens(input_ids), None
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_caches)):
            x, residual = layer(x, residual, cos, sin, meta, k_cache, v_cache, backend,
                                None if lora is None else lora.layer(i))
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- checkpoint loading ------------------------------------------------------------------
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_hf_weights(self, weights) -> None:
        """Copy (name, tensor) pairs of a HF checkpoint into the fused modules; every parameter
        must be covered exactly once."""
        params = dict(self.named_parameters())
        spec = self.spec
        shard_sizes = {"qkv_proj": [spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                                    spec.num_kv_heads * spec.head_dim],
                       "gate_up_proj": [spec.intermediate_size, spec.intermediate_size]}
        loaded: set[str] = set()
        tied_head = None        # a tied checkpoint's own lm_head, compared with the embedding below
        for name, tensor in weights:
            if name == "lm_head.weight" and spec.tie_word_embeddings:
                tied_head = tensor
                continue
            if "rotary_emb" in name:
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in self._FUSED:
                fused, shard = self._FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            if shard is None:
                dest = param.data
            else:
                sizes = shard_sizes[target.split(".")[-2]]
                dest = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(name)
        expected = self._expected_checkpoint_names()
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
        if tied_head is not None:
            self._keep_own_lm_head(tied_head)

    def _keep_own_lm_head(self, head: torch.Tensor) -> None:
        """A tied config whose checkpoint also holds an lm_head.weight: one that differs from the
        embedding is kept untied, as transformers (5.x) keeps it, with a warning."""
        embedding = self.model.embed_tokens.weight
        if head.shape != embedding.shape:
            raise ValueError(f"checkpoint tensor 'lm_head.weight' has shape {tuple(head.shape)}, "
                             f"expected {tuple(embedding.shape)}")
        head = head.to(embedding.device, embedding.dtype)
        if not torch.equal(head, embedding.data):
            log.warning("inflight: config.json ties the word embeddings, but the checkpoint's lm_head.weight "
                        "differs from embed_tokens.weight: using the lm_head, as transformers does")
            self.lm_head.weight = nn.Parameter(head, requires_grad=False)

    def _expected_checkpoint_names(self) -> set[str]:
        names = set()
        for name, _ in self.named_parameters(remove_duplicate=False):
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] == "qkv_proj":
                names.update(".".join(parts[:-2] + [p, parts[-1]]) for p in ("q_proj", "k_proj", "v_proj"))
            elif len(parts) >= 2 and parts[-2] == "gate_up_proj":
                names.update(".".join(parts[:-2] + [p, parts[-1]]) for p in ("gate_proj", "up_proj"))
            else:
                names.add(name)
        return names


class LlamaForSequenceClassification(LlamaForCausalLM):
    """The decoder with transformers' score head in place of the LM head: num_labels logits per
    token, of which the last prompt token's classify the prompt. The head runs in float32, as
    vLLM runs a pooling model's head (its head_dtype)."""

    def add_head(self) -> None:
        self.score = nn.Linear(self.spec.hidden_size, self.spec.num_labels, bias=False)

    def tie_weights(self) -> None:
        pass

    def to(self, *args, **kwargs):
        """The score head stays float32 whatever dtype the decoder takes."""
        super().to(*args, **kwargs)
        self.score.float()
        return self

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden.float())

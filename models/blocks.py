"""Shared blocks every decoder family builds its layers from: RMSNorm, RoPE, causal attention,
the attention block, the gated MLP, the pre-norm decoder layer and the causal LM around them.

The forward pass works on flattened tokens: `input_ids [T]`, `positions [T]` and
`query_start_loc [S+1]` (where each packed sequence starts). Five functions are leaves for
torch.fx (`rmsnorm`, `head_rmsnorm`, `rope`, `causal_attention`, `softcap`): the frontend sees
each as one call and turns it into one IR op; eagerly they run the torch references in
`compiler/ops/`. Parameter paths are
llmc's canonical weight names (see models/config.py), so a block's weights sit directly on its
layer (`layers.{i}.q_proj`), not in a sub-module.

What a config turns on (q/k norms, sliding layers, soft-caps, the activation, the embedding
scale) the shared blocks do; a family changes what differs in structure by subclassing
(`DecoderLayer.forward`: where the norms sit) and hands its layer class to `CausalLM`.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from llmc.compiler.ops.attention import attention_ref
from llmc.compiler.ops.elementwise import softcap_ref
from llmc.compiler.ops.norms import head_rmsnorm_ref, rmsnorm_ref, rounding_attr
from llmc.compiler.ops.rope import rope_ref

from .config import ModelConfig


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, rounding: str = "normed") -> torch.Tensor:
    return rmsnorm_ref(x, weight, eps, rounding)


def head_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int,
                 rounding: str = "normed") -> torch.Tensor:
    return head_rmsnorm_ref(x, weight, eps, head_dim, rounding)


def rope(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float, scaling,
         rotary_dim: int | None = None) -> torch.Tensor:
    if rotary_dim is None or rotary_dim == head_dim:
        return rope_ref(x, positions, head_dim, theta, scaling)
    return rope_ref(x, positions, head_dim, theta, scaling, rotary_dim=rotary_dim)


def causal_attention(q, k, v, query_start_loc, num_heads: int, num_kv_heads: int, head_dim: int,
                     scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    if not window and not softcap:
        return attention_ref(q, k, v, query_start_loc, head_dim, scale)
    return attention_ref(q, k, v, query_start_loc, head_dim, scale, window=window, softcap=softcap)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return softcap_ref(x, cap)


torch.fx.wrap("rmsnorm")
torch.fx.wrap("head_rmsnorm")
torch.fx.wrap("rope")
torch.fx.wrap("causal_attention")
torch.fx.wrap("softcap")


class RMSNorm(nn.Module):
    """rmsnorm of x with this weight; `rounding` as ModelConfig.norm_rounding (passed to the leaf
    only when not the default, so graphs without the choice trace as before)."""

    def __init__(self, dim: int, eps: float, rounding: str = "normed"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.rounding = eps, rounding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps, **rounding_attr(self.rounding))


class DecoderLayer(nn.Module):
    """Pre-norm attention block and gated MLP block, each with a residual add (Llama's layer).

    What the config turns on is here too, so a family only arranges the blocks: q/k RMSNorm before
    RoPE (`cfg.qk_norm`), the layer's RoPE base and sliding window (`cfg.layer_types`), the score
    scale and soft-cap, partial rotary, and the MLP's activation.
    """

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.cfg, self.index = cfg, index
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_rounding)
        self.q_proj = nn.Linear(cfg.hidden_size, q_width, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_width, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_width, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_width, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(cfg.head_dim if per_head else q_width, cfg.rms_norm_eps, cfg.norm_rounding)
            self.k_norm = RMSNorm(cfg.head_dim if per_head else kv_width, cfg.rms_norm_eps, cfg.norm_rounding)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_rounding)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def queries_keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H*D] and k [T, KVH*D] as RoPE takes them: projected, then normed if the config says."""
        cfg, q, k = self.cfg, self.q_proj(x), self.k_proj(x)
        if cfg.qk_norm == "head":
            eps = cfg.rms_norm_eps
            rounding = rounding_attr(cfg.norm_rounding)
            return (head_rmsnorm(q, self.q_norm.weight, eps, cfg.head_dim, **rounding),
                    head_rmsnorm(k, self.k_norm.weight, eps, cfg.head_dim, **rounding))
        if cfg.qk_norm == "all":
            return self.q_norm(q), self.k_norm(k)
        return q, k

    def attention(self, x: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """Q/K/V projections, RoPE on q and k, causal GQA attention, output projection."""
        cfg = self.cfg
        theta, scaling = cfg.rope_of(self.index)
        q, k = self.queries_keys(x)
        q = rope(q, positions, cfg.head_dim, theta, scaling, *self._rotary())              # [T, H*D]
        k = rope(k, positions, cfg.head_dim, theta, scaling, *self._rotary())              # [T, KVH*D]
        v = self.v_proj(x)                                                                  # [T, KVH*D]
        attn = causal_attention(q, k, v, query_start_loc, cfg.num_heads, cfg.num_kv_heads,
                                cfg.head_dim, cfg.scale, **self._attention_options())      # [T, H*D]
        return self.o_proj(attn)                                                            # [T, hidden]

    def _rotary(self) -> tuple[int, ...]:
        """RoPE's rotary_dim argument, passed only for partial rotary."""
        rotary = self.cfg.rotary_dim
        return (rotary,) if rotary is not None and rotary != self.cfg.head_dim else ()

    def _attention_options(self) -> dict:
        """The window and soft-cap this layer attends with, passed only where set."""
        options = {}
        if self.cfg.is_sliding(self.index):
            options["window"] = self.cfg.sliding_window
        if self.cfg.attn_softcap:
            options["softcap"] = float(self.cfg.attn_softcap)
        return options

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)), act SiLU or GELU (tanh approximation)."""
        gate = self.gate_proj(x)
        act = F.silu(gate) if self.cfg.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * self.up_proj(x))                                        # [T, hidden]

    def forward(self, h: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attn_norm(h), positions, query_start_loc)              # [T, hidden]
        return h + self.mlp(self.mlp_norm(h))


class CausalLM(nn.Module):
    """Embedding (scaled by sqrt(hidden) where the config says), decoder layers of `layer` class,
    final norm and LM head (tied to the embedding or not), logits soft-capped where the config says."""

    def __init__(self, cfg: ModelConfig, layer: type[DecoderLayer] = DecoderLayer):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_rounding)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)                                          # [T, hidden]
        if self.cfg.embed_scale:
            h = h * (self.cfg.hidden_size ** 0.5)
        for layer in self.layers:
            h = layer(h, positions, query_start_loc)
        h = self.norm(h)
        if logits_indices is not None:
            h = torch.index_select(h, 0, logits_indices)                          # [R, hidden]
        if self.cfg.tie_word_embeddings:
            logits = F.linear(h, self.embed_tokens.weight)                        # [R, vocab]
        else:
            logits = self.lm_head(h)
        return softcap(logits, float(self.cfg.final_softcap)) if self.cfg.final_softcap else logits

"""Gemma 2 and Gemma 3 (text): the shared decoder with four norms a layer and Gemma's choices.

Both: GELU (tanh) gated MLP; a norm before and after each sublayer (input, post-attention,
pre-feedforward, post-feedforward); RMSNorm weights stored as (1 + w), so the HF loader adds 1
(llama.cpp's converter already did, so GGUF weights are read as they are); embeddings scaled by
sqrt(hidden); the attention scale from `query_pre_attn_scalar`; sliding-window layers per
`layer_types` (Gemma 2 alternates, Gemma 3 has 5 local : 1 global); tied embeddings.
Gemma 2 soft-caps attention scores and final logits; Gemma 3 norms q and k per head instead and
gives its sliding layers their own RoPE base (`rope_local_base_freq`, unscaled).
GGUF: llama.cpp does not store `query_pre_attn_scalar` or the layer pattern; it derives both, and
so does `config_from_gguf` (the 27B models scale by hidden / heads, the others by head_dim).
Norms round once, after the fp32 product with the weight (norm_rounding "product"), as
transformers' Gemma2RMSNorm/Gemma3RMSNorm do. Known difference in a bf16 (or f16) artifact: the
stored multiplier 1 + w is rounded to the artifact's dtype, while transformers forms 1 + w in
fp32 from its bf16 w and never rounds it; for bf16 the two multipliers differ on about half the
weights and a quarter of a norm's outputs land an ulp apart. Keeping norm weights in fp32 would
close it, but every norm kernel (generated, native rope_kv_write, step plan, Triton) takes
weights of x's dtype today. fp32 artifacts are exact.
"""

from __future__ import annotations

from typing import Any

import torch

from ..blocks import CausalLM, DecoderLayer, RMSNorm
from ..config import ModelConfig, periodic_layers
from .family import LLAMA_GGUF_LAYER_NAMES, LLAMA_HF_LAYER_NAMES, Family
from .hf_fields import decoder_fields, rope_fields


# The instruction-tuned checkpoints' template (text turns; a system message leads the first user turn in
# Gemma 3's, and Gemma 2's refuses one), for GGUF files that carry none.
_TURNS = ("{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
          "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}"
          "{%- set role = message['role'] -%}{%- endif -%}"
          "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
          "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
GEMMA3_TEMPLATE = ("{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
                   "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
                   "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
                   + _TURNS)
GEMMA2_TEMPLATE = ("{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
                   "{{ raise_exception('System role not supported') }}{%- endif -%}"
                   "{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}" + _TURNS)


class GemmaLayer(DecoderLayer):
    """h + post_attn_norm(attn(attn_norm(h))), then h + post_mlp_norm(mlp(mlp_norm(h)))."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_rounding)
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_rounding)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attn_norm(self.attention(self.attn_norm(h), positions, query_start_loc))
        return h + self.post_mlp_norm(self.mlp(self.mlp_norm(h)))                 # [T, hidden]


def causal_lm(cfg: ModelConfig) -> CausalLM:
    return CausalLM(cfg, GemmaLayer)


GEMMA_HF_LAYER_NAMES = {
    **LLAMA_HF_LAYER_NAMES, "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm",
    "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm",
}
GEMMA_GGUF_LAYER_NAMES = {
    **LLAMA_GGUF_LAYER_NAMES, "post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_mlp_norm",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
}


def _gemma_fields(raw: dict[str, Any], sliding_pattern: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share, read from config.json."""
    fields = decoder_fields(raw, cap_at_window=False) | dict(
        hidden_act="gelu_tanh", embed_scale=True, attn_scale=float(raw["query_pre_attn_scalar"]) ** -0.5,
        norm_rounding="product",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        max_position_embeddings=raw.get("max_position_embeddings", 8192))
    layers = fields["num_layers"]
    types = raw.get("layer_types") or periodic_layers(layers, sliding_pattern)
    if raw.get("sliding_window") and "sliding_attention" in types:
        fields |= dict(layer_types=tuple(types), sliding_window=int(raw["sliding_window"]))
    return fields


def gemma2_config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    fields = _gemma_fields(raw, sliding_pattern=2)
    fields |= dict(attn_softcap=raw.get("attn_logit_softcapping"), final_softcap=raw.get("final_logit_softcapping"))
    return ModelConfig(architecture=architecture, **fields)


def gemma3_config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    fields = _gemma_fields(raw, sliding_pattern=raw.get("sliding_window_pattern", 6))
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:             # transformers 5.x: RoPE per layer type
        theta, scaling = rope_fields({"rope_parameters": params["full_attention"]})
        local = params.get("sliding_attention", {}).get("rope_theta", 10000.0)
    else:
        theta, scaling = rope_fields({**raw, "rope_theta": raw.get("rope_theta", 1_000_000.0)})
        local = raw.get("rope_local_base_freq", 10000.0)
    fields |= dict(qk_norm="head", rope_theta=theta, rope_scaling=scaling, local_rope_theta=float(local),
                   attn_softcap=raw.get("attn_logit_softcapping"), final_softcap=raw.get("final_logit_softcapping"))
    return ModelConfig(architecture=architecture, **fields)


def _gguf_scale(fields: dict[str, Any]) -> float:
    """llama.cpp's attention scale for Gemma GGUF files: hidden / heads for the 27B models (62 or
    46 layers), head_dim for the others (as `query_pre_attn_scalar` is in their config.json)."""
    big = fields["num_layers"] in (46, 62)
    return float(fields["hidden_size"] // fields["num_heads"] if big else fields["head_dim"]) ** -0.5


def _gguf_layer_types(layers: int, value, default_pattern: int) -> tuple[str, ...]:
    """Each layer's type: `attention.sliding_window_pattern` where the file has it (a period, or a
    flag per layer), else the family's period (every `default_pattern`-th layer full)."""
    pattern = value("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        return tuple("sliding_attention" if flag else "full_attention" for flag in pattern)
    return periodic_layers(layers, int(pattern or default_pattern))


def gemma2_config_from_gguf(fields: dict[str, Any], value) -> ModelConfig:
    window = value("attention.sliding_window")
    return ModelConfig(architecture="Gemma2ForCausalLM", **fields | dict(
        hidden_act="gelu_tanh", embed_scale=True, attn_scale=_gguf_scale(fields), norm_rounding="product",
        attn_softcap=value("attn_logit_softcapping"), final_softcap=value("final_logit_softcapping"),
        layer_types=_gguf_layer_types(fields["num_layers"], value, 2) if window else (),
        sliding_window=int(window) if window else None))


def gemma3_config_from_gguf(fields: dict[str, Any], value) -> ModelConfig:
    window = value("attention.sliding_window")
    return ModelConfig(architecture="Gemma3ForCausalLM", **fields | dict(
        hidden_act="gelu_tanh", embed_scale=True, attn_scale=_gguf_scale(fields), qk_norm="head",
        norm_rounding="product",
        layer_types=_gguf_layer_types(fields["num_layers"], value, 6) if window else (),
        sliding_window=int(window) if window else None, local_rope_theta=10000.0))


GEMMA2 = Family(
    name="gemma2", hf_architectures=("Gemma2ForCausalLM",), hf_model_types=("gemma2",),
    config_from_hf=gemma2_config_from_hf, causal_lm=causal_lm, gguf_architecture="gemma2",
    config_from_gguf=gemma2_config_from_gguf, hf_layer_names=GEMMA_HF_LAYER_NAMES,
    gguf_layer_names=GEMMA_GGUF_LAYER_NAMES, hf_norm_offset=1.0, chat_template=GEMMA2_TEMPLATE,
)
GEMMA3 = Family(
    name="gemma3", hf_architectures=("Gemma3ForCausalLM",), hf_model_types=("gemma3_text",),
    config_from_hf=gemma3_config_from_hf, causal_lm=causal_lm, gguf_architecture="gemma3",
    config_from_gguf=gemma3_config_from_gguf, hf_layer_names=GEMMA_HF_LAYER_NAMES,
    gguf_layer_names=GEMMA_GGUF_LAYER_NAMES, hf_norm_offset=1.0, chat_template=GEMMA3_TEMPLATE,
)

"""OLMo-2: norms after each sublayer only (no pre-norm), and RMSNorm of q and k over the whole
projection (weights [heads * head_dim]), not per head.

'olmo2' GGUF files keep Hugging Face's Q/K row order; the layer's norms are `post_attention_norm`,
`post_ffw_norm`, `attn_q_norm` and `attn_k_norm`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..blocks import CausalLM, DecoderLayer, RMSNorm
from ..config import ModelConfig
from .family import Family
from .hf_fields import decoder_fields

OLMO2_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
                  "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
                  "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
                  "{% if not loop.last %}{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
                  "{% else %}{{ '<|assistant|>\\n' + message['content'] + eos_token }}{% endif %}{% endif %}"
                  "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}")


class Olmo2Layer(DecoderLayer):
    """h + post_attn_norm(attn(h)), then h + post_mlp_norm(mlp(h))."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        del self.attn_norm, self.mlp_norm                       # OLMo-2 norms outputs, not inputs
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_rounding)
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_rounding)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attn_norm(self.attention(h, positions, query_start_loc))
        return h + self.post_mlp_norm(self.mlp(h))                               # [T, hidden]


def causal_lm(cfg: ModelConfig) -> CausalLM:
    return CausalLM(cfg, Olmo2Layer)


OLMO2_FIELDS = {"qk_norm": "all", "norm_rounding": "product"}   # norms round once, after the weight


def config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    return ModelConfig(architecture=architecture, **(decoder_fields(raw) | OLMO2_FIELDS))


def config_from_gguf(fields: dict[str, Any], value) -> ModelConfig:
    return ModelConfig(architecture="Olmo2ForCausalLM", **(fields | OLMO2_FIELDS))


FAMILY = Family(
    name="olmo2",
    hf_architectures=("Olmo2ForCausalLM",),
    hf_model_types=("olmo2",),
    config_from_hf=config_from_hf,
    causal_lm=causal_lm,
    gguf_architecture="olmo2",
    config_from_gguf=config_from_gguf,
    hf_layer_names={
        "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
        "self_attn.o_proj": "o_proj", "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm",
        "post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm",
        "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "down_proj",
    },
    gguf_layer_names={
        "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
        "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "post_attention_norm": "post_attn_norm",
        "post_ffw_norm": "post_mlp_norm", "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
    },
    chat_template=OLMO2_TEMPLATE,
)

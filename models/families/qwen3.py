"""Qwen3 (dense): Llama's layers with per-head RMSNorm of q and k before RoPE and no qkv bias.

head_dim is config.json's own (128 where hidden / heads would give 64 or 80). A sliding window the
config turns on caps the served length, as for Qwen2. 'qwen3' GGUF files keep Hugging Face's Q/K
row order and name the norms `attn_q_norm` / `attn_k_norm`.
"""

from __future__ import annotations

from typing import Any

from ..blocks import CausalLM
from ..config import ModelConfig
from .family import LLAMA_GGUF_LAYER_NAMES, LLAMA_HF_LAYER_NAMES, Family
from .hf_fields import decoder_fields

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")


def config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    return ModelConfig(architecture=architecture, **(decoder_fields(raw) | {"qk_norm": "head"}))


def config_from_gguf(fields: dict[str, Any], value) -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", **(fields | {"qk_norm": "head"}))


FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    config_from_hf=config_from_hf,
    causal_lm=CausalLM,
    gguf_architecture="qwen3",
    config_from_gguf=config_from_gguf,
    hf_layer_names={**LLAMA_HF_LAYER_NAMES, "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"},
    gguf_layer_names={**LLAMA_GGUF_LAYER_NAMES, "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"},
    chat_template=CHATML,
)

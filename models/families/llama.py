"""Llama (Llama 2/3, SmolLM, TinyLlama...): the shared pre-norm decoder as it stands.

Q/K/V biases only when config.json says `attention_bias`. llama.cpp's converter interleaves the
Q/K rows of 'llama' GGUF files (the GGUF loader undoes it).
"""

from __future__ import annotations

from typing import Any

from ..blocks import CausalLM
from ..config import ModelConfig
from .family import Family
from .hf_fields import decoder_fields


def config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    """A Llama config.json as the shared fields read it (Q/K/V biases when `attention_bias`)."""
    return ModelConfig(architecture=architecture, **decoder_fields(raw))


FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_types=("llama",),
    config_from_hf=config_from_hf,
    causal_lm=CausalLM,
    gguf_architecture="llama",
    gguf_permuted_qk=True,
)

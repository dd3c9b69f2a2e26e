"""Qwen2 (and Qwen2.5): Llama's layers with Q/K/V biases always.

A sliding window the config turns on (`use_sliding_window`) caps the served sequence length, as
for Mistral. 'qwen2' GGUF files keep Hugging Face's Q/K row order (not permuted).
"""

from __future__ import annotations

from typing import Any

from ..blocks import CausalLM
from ..config import ModelConfig
from .family import Family
from .hf_fields import decoder_fields


def config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    fields = decoder_fields(raw)  # caps the length at a sliding window the config turns on
    return ModelConfig(architecture=architecture, **(fields | {"qkv_bias": True}))


FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    config_from_hf=config_from_hf,
    causal_lm=CausalLM,
    gguf_architecture="qwen2",
)

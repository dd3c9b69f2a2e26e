"""Mistral: Llama's layers; a sliding window in config.json applies to every layer.

Every layer attends to the last `sliding_window` tokens (itself included), as transformers' Mistral
does; the KV cache still keeps every token (see `llmc plan`). llama.cpp writes Mistral GGUF files as
architecture 'llama', so they load as the llama family (and attend fully).
"""

from __future__ import annotations

from typing import Any

from ..blocks import CausalLM
from ..config import ModelConfig, sliding_everywhere
from .family import Family
from .hf_fields import decoder_fields


def config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    fields = decoder_fields(raw, cap_at_window=False)
    if raw.get("sliding_window"):
        fields |= sliding_everywhere(fields["num_layers"], raw["sliding_window"])
    return ModelConfig(architecture=architecture, **fields)


FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    hf_model_types=("mistral",),
    config_from_hf=config_from_hf,
    causal_lm=CausalLM,
)

"""Mistral: Llama's layers; a sliding window in config.json caps the served sequence length.

llmc attends fully (no window), exact only up to the window, so `max_position_embeddings` is
capped at `sliding_window` when the config turns it on (hf_fields.window_capped, which every family
so far applies). llama.cpp writes Mistral GGUF files as architecture 'llama', so they load as the
llama family.
"""

from __future__ import annotations

from typing import Any

from ..blocks import CausalLM
from ..config import ModelConfig
from .family import Family
from .hf_fields import decoder_fields


def config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    fields = decoder_fields(raw)  # caps the length at a sliding window the config turns on
    return ModelConfig(architecture=architecture, **fields)


FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    hf_model_types=("mistral",),
    config_from_hf=config_from_hf,
    causal_lm=CausalLM,
)

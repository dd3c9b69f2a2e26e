"""What a model family is: the names it answers to, how its config maps, how its layers are built.

A family module (models/families/<name>.py) makes one `Family` and the registry
(models/families/__init__.py) lists it. The loaders, the config check and the frontend ask the
registry, so a new family is its module plus one line in the registry's list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from torch import nn

from ..config import ModelConfig

# The Llama checkpoint layout, which every family so far shares. HF: the path after
# `model.layers.{i}.`; GGUF: the tensor after `blk.{i}.`; values: llmc's canonical names.
LLAMA_HF_LAYER_NAMES = MappingProxyType({
    "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
    "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "down_proj",
})
LLAMA_GGUF_LAYER_NAMES = MappingProxyType({
    "attn_norm": "attn_norm", "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
    "attn_output": "o_proj", "ffn_norm": "mlp_norm", "ffn_gate": "gate_proj",
    "ffn_up": "up_proj", "ffn_down": "down_proj",
})

HfConfig = Callable[[dict[str, Any], str], ModelConfig]
GgufConfig = Callable[[dict[str, Any], Callable[[str], Any]], ModelConfig]


@dataclass(frozen=True)
class Family:
    """One decoder family.

    name               registry key, a lower-case identifier ('llama')
    hf_architectures   config.json `architectures[0]` values it loads; the first is the
                       ModelConfig.architecture of a config read from GGUF or from `model_type`
    hf_model_types     config.json `model_type` values it loads when `architectures` is absent
    config_from_hf     (config.json dict, architecture) -> ModelConfig; a missing required key
                       raises KeyError (the loader turns it into one sentence)
    causal_lm          ModelConfig -> the nn.Module the frontend traces, built from models/blocks.py
    gguf_architecture  GGUF `general.architecture` it loads; None: it has none of its own
    config_from_gguf   (the ModelConfig keywords every GGUF decoder has, less `architecture`;
                       `value(key)` reading metadata `{gguf_architecture}.{key}` or None)
                       -> ModelConfig; None: those keywords under hf_architectures[0]
    gguf_permuted_qk   llama.cpp's converter interleaved this family's Q/K rows (the loader undoes it)
    hf_layer_names     HF layer weight path -> canonical name (see LLAMA_HF_LAYER_NAMES)
    gguf_layer_names   GGUF layer tensor -> canonical name (see LLAMA_GGUF_LAYER_NAMES)
    fused_weights      canonical name of a weight the checkpoint stores fused -> the canonical
                       weights it holds, stacked along rows in this order (Phi-3's qkv_proj)
    hf_norm_offset     added to every RMSNorm weight read from config.json's checkpoint (Gemma
                       stores w for a (1 + w) norm: 1.0); GGUF files hold the multiplier itself
    chat_template      the family's known chat template (Jinja, as its tokenizer_config.json has
                       it), for a GGUF file that carries none; None: such a file has no template
    """

    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    config_from_hf: HfConfig
    causal_lm: Callable[[ModelConfig], nn.Module]
    gguf_architecture: str | None = None
    config_from_gguf: GgufConfig | None = None
    gguf_permuted_qk: bool = False
    hf_layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_HF_LAYER_NAMES)
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    fused_weights: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    hf_norm_offset: float = 0.0
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"family name {self.name!r} must be a lower-case identifier")
        if not self.hf_architectures:
            raise ValueError(f"family {self.name!r} names no Hugging Face architecture")
        if self.gguf_architecture is None and (self.gguf_permuted_qk or self.config_from_gguf):
            raise ValueError(f"family {self.name!r} says how to read GGUF but names no GGUF architecture")

    @property
    def architecture(self) -> str:
        """The ModelConfig.architecture this family records when the source names none of its own."""
        return self.hf_architectures[0]

    def split_fused(self, weights: dict[str, Any], expected: Mapping[str, tuple[int, ...]],
                    cut: Callable[[Any, int, int], Any] = lambda w, start, stop: w[start:stop]) -> None:
        """Replace, in place, each fused weight (`fused_weights`) by its parts, rows [start, stop) of it
        as `cut` takes them, at the part heights `expected` (the canonical shapes) gives:
        `layers.3.qkv_proj.weight` -> `layers.3.q_proj.weight`, `...k_proj...`, `...v_proj...`. A fused
        weight whose rows do not add up is left whole, for check_weights to name."""
        for name in [n for n in weights if n.count(".") >= 2 and n.split(".")[-2] in self.fused_weights]:
            prefix, fused, suffix = name.rsplit(".", 2)
            parts = [f"{prefix}.{part}.{suffix}" for part in self.fused_weights[fused]]
            if not all(p in expected for p in parts):
                continue
            heights = [expected[p][0] for p in parts]
            if sum(heights) == weights[name].shape[0]:
                whole, start = weights.pop(name), 0
                for part, height in zip(parts, heights):
                    weights[part], start = cut(whole, start, start + height), start + height

    def gguf_config(self, fields: dict[str, Any], value: Callable[[str], Any]) -> ModelConfig:
        """This family's ModelConfig from the shared GGUF fields (see `config_from_gguf`)."""
        if self.config_from_gguf is None:
            return ModelConfig(architecture=self.architecture, **fields)
        return self.config_from_gguf(fields, value)

"""Phi-3 and Phi-4-mini: Llama's layers with the checkpoint's qkv and gate/up projections fused,
partial rotary (Phi-4-mini turns 3/4 of each head) and `longrope` scaling.

The loaders split `qkv_proj` into q, k, v and `gate_up_proj` into gate (first half) and up, so the
model is the shared one and merge_qkv / merge_gate_up fuse them again for the kernels. A
`sliding_window` in config.json applies to every layer (Phi-3-mini's 2047), as transformers does.
LongRoPE: one set of factors per artifact, chosen at compile time by `longrope_choice` (see
compiler/ops/rope.py): transformers switches sets per forward call by the call's length, which
would rotate one sequence's keys with both sets depending on how it was chunked.
"""

from __future__ import annotations

from typing import Any

from llmc.compiler.ops.rope import longrope_choice

from ..blocks import CausalLM
from ..config import ModelConfig, ModelError, sliding_everywhere
from .family import LLAMA_GGUF_LAYER_NAMES, LLAMA_HF_LAYER_NAMES, Family
from .hf_fields import decoder_fields

PHI3_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
                 "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
                 "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
                 "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")


def _longrope(scaling: dict[str, Any], max_positions: int, original: int | None) -> dict[str, Any]:
    """longrope_choice, a malformed LongRoPE config as one ModelError."""
    try:
        return longrope_choice(scaling, max_positions, original)
    except ValueError as exc:
        raise ModelError(f"the Phi-3 config's LongRoPE scaling is malformed: {exc}") from None


def config_from_hf(raw: dict[str, Any], architecture: str) -> ModelConfig:
    fields = decoder_fields(raw, cap_at_window=False)
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        fields["rotary_dim"] = int(fields["head_dim"] * partial)
    if fields["rope_scaling"] and fields["rope_scaling"].get("rope_type", fields["rope_scaling"].get("type")) == "longrope":
        original = fields["rope_scaling"].get("original_max_position_embeddings",
                                              raw.get("original_max_position_embeddings"))
        fields["rope_scaling"] = _longrope(fields["rope_scaling"], fields["max_position_embeddings"], original)
    if raw.get("sliding_window"):
        fields |= sliding_everywhere(fields["num_layers"], raw["sliding_window"])
    return ModelConfig(architecture=architecture, **fields)


def config_from_gguf(fields: dict[str, Any], value) -> ModelConfig:
    """llama.cpp's `phi3` metadata: `rope.dimension_count` is the rotary part of a head (head_dim is
    hidden / heads), `attention.sliding_window` the window of every layer; LongRoPE factors (read
    from the file's factor tensors) chosen as for a Hugging Face config."""
    head_dim = fields["hidden_size"] // fields["num_heads"]
    rotary, window = value("rope.dimension_count"), value("attention.sliding_window")
    fields = fields | {"head_dim": head_dim}
    if rotary and int(rotary) != head_dim:
        fields["rotary_dim"] = int(rotary)
    if window:
        fields |= sliding_everywhere(fields["num_layers"], window)
    scaling = fields["rope_scaling"]
    if scaling and scaling["rope_type"] == "longrope":
        fields["rope_scaling"] = _longrope(scaling, fields["max_position_embeddings"],
                                           scaling["original_max_position_embeddings"])
    return ModelConfig(architecture="Phi3ForCausalLM", **fields)


FAMILY = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    hf_model_types=("phi3",),
    config_from_hf=config_from_hf,
    causal_lm=CausalLM,
    gguf_architecture="phi3",
    config_from_gguf=config_from_gguf,
    hf_layer_names={**LLAMA_HF_LAYER_NAMES, "self_attn.qkv_proj": "qkv_proj", "mlp.gate_up_proj": "gate_up_proj"},
    gguf_layer_names={**LLAMA_GGUF_LAYER_NAMES, "attn_qkv": "qkv_proj", "ffn_up": "gate_up_proj"},
    fused_weights={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    chat_template=PHI3_TEMPLATE,
)

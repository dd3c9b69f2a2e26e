"""The config.json fields every decoder family so far reads the same way.

A family's `config_from_hf` starts from `decoder_fields(raw)` (ModelConfig keywords, less
`architecture`) and changes what it does differently.
"""

from __future__ import annotations

from typing import Any


def rope_fields(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Theta and scaling from either transformers 4.x keys or 5.x `rope_parameters`."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def decoder_fields(raw: dict[str, Any], cap_at_window: bool = True) -> dict[str, Any]:
    """ModelConfig keywords (all but `architecture`) of a Llama-layout config.json; KeyError for a
    missing required key. A sliding window the config turns on caps max_position_embeddings, unless
    the family attends within it (`cap_at_window=False`)."""
    heads = raw["num_attention_heads"]
    theta, scaling = rope_fields(raw)
    eos = raw.get("eos_token_id")
    return dict(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=(window_capped(raw, raw.get("max_position_embeddings", 4096)) if cap_at_window
                                 else raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
    )


def window_capped(raw: dict[str, Any], max_positions: int) -> int:
    """`max_positions` capped at a sliding window the config turns on: llmc attends fully, which is
    exact only within the window, so it serves no longer sequences than the window."""
    if raw.get("sliding_window") and raw.get("use_sliding_window", True):
        return min(max_positions, raw["sliding_window"])
    return max_positions

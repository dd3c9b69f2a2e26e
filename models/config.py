"""The model description every loader produces and every later stage reads.

`ModelConfig` is the architecture (what the frontend traces); `LoadedModel` is a config plus
weights in llmc's canonical names plus the tokenizer files, whatever the source format was.

Canonical weight names (the keys of `LoadedModel.weights`):

    embed_tokens.weight                         [vocab, hidden]
    layers.{i}.attn_norm.weight                 [hidden]
    layers.{i}.{q,k,v}_proj.weight (+ .bias)    [heads * head_dim, hidden]
    layers.{i}.o_proj.weight                    [hidden, heads * head_dim]
    layers.{i}.mlp_norm.weight                  [hidden]
    layers.{i}.{gate,up}_proj.weight            [intermediate, hidden]
    layers.{i}.down_proj.weight                 [hidden, intermediate]
    norm.weight                                 [hidden]
    lm_head.weight                              [vocab, hidden]  (absent when tied)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


class ModelError(Exception):
    """A model that llmc cannot load; the message names the problem and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder of one registered family (models/families); `architecture` is the
    Hugging Face architecture name that says which."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        from .families import family_of  # the families import this module: ask at call time
        family_of(self.architecture)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelError(f"model config has {name}={getattr(self, name)}; it must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs whole groups"
            )
        if self.head_dim % 2:
            raise ModelError(f"head_dim={self.head_dim} is odd; rotary embeddings need an even head_dim")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ModelError(f"model config has unknown keys {sorted(unknown)}; it was written by a newer llmc")
        data = dict(data)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)


@dataclass(frozen=True)
class TokenizerFiles:
    """A Hugging Face `tokenizer.json` (as text) plus what the chat template needs."""

    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False

    def config_dict(self) -> dict[str, Any]:
        return {
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
        }


@dataclass
class LoadedModel:
    """What a loader returns: architecture, canonical weights, tokenizer and provenance."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TokenizerFiles
    source_files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    source_format: str = "hf"
    source_path: str = ""          # where it was loaded from (recorded in the artifact's manifest)
    quantized: dict = field(default_factory=dict)  # name -> QuantizedWeight the file stores (compiler/quant_format.py)


def expected_weights(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight of `cfg` with its shape."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"embed_tokens.weight": (cfg.vocab_size, hidden), "norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm.weight": (hidden,), p + "mlp_norm.weight": (hidden,),
                   p + "q_proj.weight": (q, hidden), p + "k_proj.weight": (kv, hidden),
                   p + "v_proj.weight": (kv, hidden), p + "o_proj.weight": (hidden, q),
                   p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden),
                   p + "down_proj.weight": (hidden, inter)}
        if cfg.qkv_bias:
            shapes |= {p + "q_proj.bias": (q,), p + "k_proj.bias": (kv,), p + "v_proj.bias": (kv,)}
    return shapes


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise ModelError for a missing, unexpected or wrongly shaped weight."""
    expected = expected_weights(cfg)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise ModelError(f"{source} has no weight {missing[0]!r} (of {len(missing)} missing); "
                         "the checkpoint is incomplete or its config does not match it")
    if extra:
        raise ModelError(f"{source} has weight {extra[0]!r} that the config does not use; "
                         "the file holds a variant llmc does not support")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelError(f"{source}: weight {name!r} has shape {tuple(weights[name].shape)}, "
                             f"the config implies {shape}")

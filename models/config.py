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

and where a family has them (the parameters of its model are the list: `expected_weights`):

    layers.{i}.{q,k}_norm.weight                [head_dim] (per head) or [heads * head_dim] (whole)
    layers.{i}.post_attn_norm.weight            [hidden]  norm of the attention's output (Gemma, OLMo-2)
    layers.{i}.post_mlp_norm.weight             [hidden]  norm of the MLP's output (Gemma, OLMo-2)

A norm weight is the multiplier itself: Gemma's (1 + w) is stored as 1 + w.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


HIDDEN_ACTS = ("silu", "gelu_tanh")
QK_NORMS = ("", "head", "all")
NORM_ROUNDINGS = ("normed", "product")   # compiler/ops/norms.py: where an RMSNorm rounds to x's dtype
LAYER_TYPES = ("full_attention", "sliding_attention")


def periodic_layers(num_layers: int, period: int) -> tuple[str, ...]:
    """Layer types with every `period`-th layer full and the others sliding (Gemma's pattern)."""
    return tuple("sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers))


def sliding_everywhere(num_layers: int, window: int) -> dict[str, Any]:
    """The ModelConfig keywords of a model whose every layer attends within `window` (Mistral, Phi-3)."""
    return dict(layer_types=("sliding_attention",) * num_layers, sliding_window=int(window))


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
    # What the newer families change (models/families); the defaults are Llama's.
    hidden_act: str = "silu"               # the gated MLP's activation: "silu" or "gelu_tanh"
    qk_norm: str = ""                      # RMSNorm of q and k before RoPE: "", "head" (each head) or "all"
    attn_scale: float | None = None        # the attention's score scale; None: head_dim ** -0.5
    layer_types: tuple[str, ...] = ()      # each layer's "full_attention" or "sliding_attention"; (): all full
    sliding_window: int | None = None      # keys a sliding layer's query sees, its own included
    local_rope_theta: float | None = None  # sliding layers' RoPE base, unscaled (Gemma 3); None: rope_theta
    attn_softcap: float | None = None      # attention scores s -> c * tanh(s / c)
    final_softcap: float | None = None     # logits likewise
    embed_scale: bool = False              # embeddings times sqrt(hidden_size), rounded to their dtype
    rotary_dim: int | None = None          # the dims of each head RoPE turns (partial rotary); None: head_dim
    norm_rounding: str = "normed"          # RMSNorms round the normed row, then times the weight ("normed",
                                           # Llama, Qwen3) or round once after the fp32 product ("product",
                                           # Gemma 2/3, OLMo-2)

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
        self._check_variants()

    def _check_variants(self) -> None:
        """The newer families' fields: known values, one layer type per layer, a window for sliding layers."""
        if self.hidden_act not in HIDDEN_ACTS:
            raise ModelError(f"hidden activation {self.hidden_act!r} is not supported; llmc has {HIDDEN_ACTS}")
        if self.qk_norm not in QK_NORMS:
            raise ModelError(f"qk_norm {self.qk_norm!r} is not one of {QK_NORMS}")
        if self.norm_rounding not in NORM_ROUNDINGS:
            raise ModelError(f"norm_rounding {self.norm_rounding!r} is not one of {NORM_ROUNDINGS}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelError(f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ModelError(f"layer type {unknown[0]!r} is not supported; llmc has {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ModelError("the config has sliding-attention layers but no positive sliding_window")
        rotary = self.rotary_dim if self.rotary_dim is not None else self.head_dim
        if not (0 < rotary <= self.head_dim and rotary % 2 == 0):
            raise ModelError(f"rotary_dim={rotary} must be even and within head_dim={self.head_dim}")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends within the sliding window."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def rope_of(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """RoPE base and scaling of layer `layer`: a sliding layer's own base where the config has one."""
        if self.is_sliding(layer) and self.local_rope_theta is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def scale(self) -> float:
        """The attention's score scale."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        out["layer_types"] = list(self.layer_types)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ModelError(f"model config has unknown keys {sorted(unknown)}; it was written by a newer llmc")
        data = dict(data)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        data["layer_types"] = tuple(data.get("layer_types", ()))
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
    """Every canonical weight of `cfg` with its shape: the parameters of its family's model, built
    on the meta device (so the definition is the one list of what a checkpoint must hold)."""
    from .families import family_of  # the families import this module: ask at call time
    with torch.device("meta"):
        module = family_of(cfg.architecture).causal_lm(cfg)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: str,
                  expected: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise ModelError for a missing, unexpected or wrongly shaped weight (`expected`: the
    caller's `expected_weights(cfg)`, where it has them already)."""
    expected = expected if expected is not None else expected_weights(cfg)
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

"""Load a Hugging Face model folder: config.json, *.safetensors, tokenizer files.

Weights are renamed to llmc's canonical names (models/config.py); the chat template comes from
`tokenizer_config.json` or `chat_template.jinja`. Every problem a user can cause (missing file,
unsupported architecture, missing weight) is a `ModelError` with one sentence.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import (SUPPORTED_ARCHITECTURES, LoadedModel, ModelConfig, ModelError, TokenizerFiles,
                     check_weights)
from .provenance import file_sha256

_LAYER_RENAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix or re-download it") from None


def _rope_fields(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Theta and scaling from either transformers 4.x keys or 5.x `rope_parameters`."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else f"<none; model_type={raw.get('model_type')!r}>"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"architecture {arch!r} in config.json is not supported; llmc compiles "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        return _config_fields(raw, arch)
    except KeyError as exc:
        raise ModelError(f"config.json lacks the field {exc.args[0]!r} that every {arch} config has") from None


def _config_fields(raw: dict[str, Any], arch: str) -> ModelConfig:
    heads = raw["num_attention_heads"]
    theta, scaling = _rope_fields(raw)
    eos = raw.get("eos_token_id")
    max_pos = raw.get("max_position_embeddings", 4096)
    if raw.get("sliding_window") and raw.get("use_sliding_window", True):
        max_pos = min(max_pos, raw["sliding_window"])  # within the window, full attention is exact
    return ModelConfig(
        architecture=arch,
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
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
    )


def canonical_name(hf_name: str) -> str | None:
    """llmc's name for a Hugging Face weight name; None for buffers llmc recomputes."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    fixed = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    m = _LAYER_RE.match(hf_name)
    if m and m.group(2) in _LAYER_RENAMES:
        return f"layers.{m.group(1)}.{_LAYER_RENAMES[m.group(2)]}.{m.group(3)}"
    raise ModelError(f"weight {hf_name!r} is not part of a Llama-family model; is the architecture right?")


def _load_safetensors(folder: Path, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], list[Path]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors file; llmc reads safetensors checkpoints only")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise ModelError(f"{path.name} cannot be read as safetensors ({exc}); re-download it") from None
        for hf_name, tensor in tensors.items():
            name = canonical_name(hf_name)
            if name is not None:
                weights[name] = tensor
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(cfg, weights, str(folder))
    return weights, files


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _load_tokenizer(folder: Path) -> tuple[TokenizerFiles, list[Path]]:
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise ModelError(f"{folder} has no tokenizer.json; llmc needs the fast-tokenizer file of the model")
    used = [tok_path]
    tok_cfg: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        used.append(folder / "tokenizer_config.json")
        tok_cfg = _read_json(folder / "tokenizer_config.json")
    template = tok_cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        used.append(folder / "chat_template.jinja")
        template = (folder / "chat_template.jinja").read_text()
    files = TokenizerFiles(
        tokenizer_json=tok_path.read_text(),
        chat_template=template if isinstance(template, str) else None,
        bos_token=_token_text(tok_cfg.get("bos_token")),
        eos_token=_token_text(tok_cfg.get("eos_token")),
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
    )
    return files, used


def load_hf_folder(folder: str | Path) -> LoadedModel:
    """Load a Hugging Face Llama/Mistral/Qwen2 folder into llmc's canonical form."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} has no config.json; give a Hugging Face model folder or a .gguf file")
    cfg = config_from_hf(_read_json(folder / "config.json"))
    weights, weight_files = _load_safetensors(folder, cfg)
    tokenizer, tok_files = _load_tokenizer(folder)
    sources = [folder / "config.json", *weight_files, *tok_files]
    return LoadedModel(cfg, weights, tokenizer, {p.name: file_sha256(p) for p in sources}, "hf")

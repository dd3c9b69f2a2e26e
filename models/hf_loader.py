"""Load a Hugging Face model folder: config.json, *.safetensors, tokenizer files.

Weights are renamed to llmc's canonical names (models/config.py); the chat template comes from
`tokenizer_config.json` or `chat_template.jinja`. Every problem a user can cause (missing file,
unsupported architecture, missing weight) is a `ModelError` with one sentence.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import LoadedModel, ModelConfig, ModelError, TokenizerFiles, check_weights, expected_weights
from .families import family_for_hf, family_of
from .families.family import LLAMA_HF_LAYER_NAMES
from .provenance import file_sha256

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix or re-download it") from None


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict, as its family maps it."""
    family, arch = family_for_hf(raw)
    try:
        return family.config_from_hf(raw, arch)
    except KeyError as exc:
        raise ModelError(f"config.json lacks the field {exc.args[0]!r} that every {arch} config has") from None


def canonical_name(hf_name: str, layer_names: Mapping[str, str] = LLAMA_HF_LAYER_NAMES) -> str | None:
    """llmc's name for a Hugging Face weight name (a layer's weights renamed by `layer_names`, a
    family's); None for buffers llmc recomputes."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    fixed = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    m = _LAYER_RE.match(hf_name)
    if m and m.group(2) in layer_names:
        return f"layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    raise ModelError(f"weight {hf_name!r} is not part of a model of this family; is the architecture right?")


def _load_safetensors(folder: Path, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], list[Path]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors file; llmc reads safetensors checkpoints only")
    weights: dict[str, torch.Tensor] = {}
    family = family_of(cfg.architecture)
    for path in files:
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise ModelError(f"{path.name} cannot be read as safetensors ({exc}); re-download it") from None
        for hf_name, tensor in tensors.items():
            name = canonical_name(hf_name, family.hf_layer_names)
            if name is not None and family.hf_norm_offset and _is_norm(name):
                weights[name] = tensor.float() + family.hf_norm_offset   # (1 + w) as the multiplier, in fp32
            elif name is not None:
                weights[name] = tensor
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    expected = expected_weights(cfg)
    family.split_fused(weights, expected)
    check_weights(cfg, weights, str(folder), expected)
    return weights, files


def _is_norm(name: str) -> bool:
    """Whether canonical weight `name` is an RMSNorm's (every norm's module name ends in `norm`)."""
    return name.endswith("norm.weight")


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
    """Load a Hugging Face folder of a registered family (models/families) into llmc's canonical form."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} has no config.json; give a Hugging Face model folder or a .gguf file")
    cfg = config_from_hf(_read_json(folder / "config.json"))
    weights, weight_files = _load_safetensors(folder, cfg)
    tokenizer, tok_files = _load_tokenizer(folder)
    sources = [folder / "config.json", *weight_files, *tok_files]
    return LoadedModel(cfg, weights, tokenizer, {p.name: file_sha256(p) for p in sources}, "hf")

"""The model the GPU check runs: SmolLM2-135M's exact shapes with seeded random weights.

The GPU machine takes only small files, so the embedded 98 MB GGUF cannot go there. `prepare`
(run on a machine that has it) writes a bundle folder of a few MB:

  config.json            SmolLM2-135M-Instruct's architecture as a Hugging Face config (from the GGUF)
  tokenizer.json         its tokenizer, rebuilt from the GGUF (models/gguf_tokenizer.py)
  tokenizer_config.json  its chat template, BOS/EOS
  site/gguf/             the gguf package (pure Python; llmc's model loader imports it), for PYTHONPATH

On the GPU machine `write_random_model` turns the bundle into a Hugging Face folder with seeded
random weights (bf16 safetensors), which both llmc and transformers load: the right shapes for
every speed figure and for comparing backends; accuracy on the real weights stays with the CPU
tests. The weights: linear layers N(0, 0.02) as transformers initialises them, norms U(0.8, 1.2),
embeddings N(0, EMBED_STD) (tied to the LM head, so logits spread over a few units and greedy picks
are not coin flips), and Q/K projections scaled by QK_GAIN so attention picks tokens.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmc.models.config import ModelConfig, ModelError, TokenizerFiles, expected_weights
from llmc.models.hf_loader import canonical_name, config_from_hf

BUNDLE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
EMBED_STD = 0.25
QK_GAIN = 4.0
LINEAR_STD = 0.02


def hf_config(cfg: ModelConfig) -> dict:
    """A Hugging Face config.json for a Llama-family `cfg` (what transformers and llmc both read)."""
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": [cfg.architecture], "model_type": cfg.architecture.removesuffix("ForCausalLM").lower(),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias, "mlp_bias": False, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos, "torch_dtype": "bfloat16",
    }


def prepare_bundle(out: Path, gguf_path: Path | None = None) -> Path:
    """Write the bundle (module docstring) from a GGUF file, by default the embedded SmolLM2."""
    from gguf import GGUFReader

    from llmc.models.embedded import embedded_model_path
    from llmc.models.gguf_loader import read_gguf_config
    from llmc.models.gguf_tokenizer import tokenizer_from_gguf

    path = gguf_path or embedded_model_path()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(read_gguf_config(path)), indent=2))
    write_tokenizer(tokenizer_from_gguf(GGUFReader(path)), out)
    site = out / "site" / "gguf"
    shutil.rmtree(site, ignore_errors=True)
    source = Path(list(importlib.util.find_spec("gguf").submodule_search_locations)[0])
    shutil.copytree(source, site, ignore=shutil.ignore_patterns("__pycache__"))
    return out


def write_tokenizer(files: TokenizerFiles, out: Path) -> None:
    (out / "tokenizer.json").write_text(files.tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(files.config_dict(), indent=2))


def read_bundle(bundle: Path) -> ModelConfig:
    """The bundle's architecture; ModelError naming the missing file and the prepare step."""
    for name in BUNDLE_FILES:
        if not (bundle / name).is_file():
            raise ModelError(f"the bundle {bundle} has no {name}; write it with `python -m llmc.tools.gpu_check "
                             f"prepare --out {bundle}` on a machine with the embedded model")
    return config_from_hf(json.loads((bundle / "config.json").read_text()))


def hf_weight_name(name: str) -> str:
    """The Hugging Face name of llmc's canonical weight `name` (the inverse of canonical_name)."""
    if not name.startswith("layers."):
        return {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(name, name)
    _, layer, part, kind = name.split(".")
    where = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
    hf = f"model.layers.{layer}.{where.get(part, 'self_attn.' + part)}.{kind}"
    assert canonical_name(hf) == name, (name, hf)
    return hf


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights of every canonical name of `cfg`, bf16 (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weights(cfg).items():
        if name.endswith("norm.weight"):
            w = torch.rand(shape, generator=g) * 0.4 + 0.8
        elif name.endswith(".bias"):
            w = torch.randn(shape, generator=g) * LINEAR_STD
        else:
            std = EMBED_STD if name in ("embed_tokens.weight", "lm_head.weight") else LINEAR_STD
            w = torch.randn(shape, generator=g) * std * (QK_GAIN if name.endswith(("q_proj.weight", "k_proj.weight"))
                                                        else 1.0)
        weights[name] = w.to(torch.bfloat16)
    return weights


def write_random_model(bundle: Path, out: Path, seed: int = 0) -> Path:
    """A Hugging Face folder: the bundle's config and tokenizer, seeded random bf16 weights."""
    cfg = read_bundle(bundle)
    out.mkdir(parents=True, exist_ok=True)
    for name in BUNDLE_FILES:
        shutil.copyfile(bundle / name, out / name)
    weights = {hf_weight_name(n): w.contiguous() for n, w in random_weights(cfg, seed).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

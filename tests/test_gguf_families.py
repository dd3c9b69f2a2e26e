"""GGUF files of each newer family, written in-process with gguf-py the way llama.cpp's converter
writes them (its tensor names and metadata, Gemma's norms stored as 1 + w, Phi-3's fused qkv and
gate/up), load to the config and weights the same model's Hugging Face folder gives."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from llmc.compiler.ops.rope import rope_attention_factor, rope_inv_freq
from llmc.models.families import FAMILIES
from llmc.models.gguf_loader import load_gguf
from llmc.models.hf_loader import load_hf_folder
from test_gguf_loader import MERGES, tiny_vocab
from tiny_models import build_hf_model, write_hf_folder

GLOBAL = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
# what GGUF metadata cannot say, so a GGUF config differs from the HF one there
NOT_IN_GGUF = ("max_position_embeddings", "bos_token_id", "eos_token_ids", "rope_scaling")
PHI3_DEFAULT_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}


def gguf_tensors(weights: dict[str, torch.Tensor], family) -> dict[str, np.ndarray]:
    """Canonical weights under llama.cpp's names, fused where the family's files fuse them."""
    to_gguf = {canonical: name for name, canonical in family.gguf_layer_names.items()}
    out = {}
    for name, w in weights.items():
        parts = name.split(".")
        if parts[0] == "layers":
            out[f"blk.{parts[1]}.{to_gguf.get(parts[2], parts[2])}.{parts[3]}"] = w.float().numpy()
        else:
            out[f"{GLOBAL[parts[0]]}.{parts[1]}"] = w.float().numpy()
    for fused, pieces in family.fused_weights.items():
        for layer in {n.split(".")[1] for n in out if n.startswith("blk.")}:
            names = [f"blk.{layer}.{to_gguf.get(p, p)}.weight" for p in pieces]
            if all(n in out for n in names):
                stacked = np.concatenate([out.pop(n) for n in names])
                out[f"blk.{layer}.{to_gguf[fused]}.weight"] = stacked
    return out


def write_family_gguf(path, arch: str, cfg, tensors: dict[str, np.ndarray], raw: dict | None = None):
    """A GGUF of architecture `arch` with `cfg`'s hyperparameters as llama.cpp writes them."""
    tokens, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "phi3":
        w.add_rope_dimension_count(cfg.rotary_dim or cfg.head_dim)
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if cfg.attn_softcap:
        w.add_attn_logit_softcapping(cfg.attn_softcap)
        w.add_final_logit_softcapping(cfg.final_softcap)
    if (cfg.rope_scaling or {}).get("rope_type") == "longrope":        # as llama.cpp's phi3 converter
        w.add_rope_scaling_orig_ctx_len(cfg.rope_scaling["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(rope_attention_factor(cfg.rope_scaling))
        for which in ("long", "short"):
            w.add_tensor(f"rope_factors_{which}.weight", np.array(cfg.rope_scaling[f"{which}_factor"], np.float32))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    for name, array in tensors.items():
        if name in (raw or {}):
            w.add_tensor(name, gguf.quants.quantize(array, raw[name]), raw_dtype=raw[name])
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("family, overrides", [
    ("qwen3", {}), ("olmo2", {}), ("phi3", PHI3_DEFAULT_ROPE),
    # the scale is head_dim's (llama.cpp derives it so for all but the 27B models), the layer pattern the family's
    ("gemma2", {"query_pre_attn_scalar": 32}),
    ("gemma3", {"query_pre_attn_scalar": 32, "layer_types": None, "num_hidden_layers": 7,
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
])
def test_a_gguf_of_each_family_loads_as_its_hf_folder(tmp_path, family, overrides):
    hf = load_hf_folder(write_hf_folder(build_hf_model(family, **overrides), tmp_path / "hf"))
    fam = FAMILIES[family]
    tensors = gguf_tensors(hf.weights, fam)
    # a fused weight kept as Q8_0 codes is split as the float ones are
    raw = {"blk.0.attn_qkv.weight": gguf.GGMLQuantizationType.Q8_0} if family == "phi3" else {}
    loaded = load_gguf(write_family_gguf(tmp_path / "m.gguf", fam.gguf_architecture, hf.config, tensors, raw))
    unset = {f: getattr(hf.config, f) for f in NOT_IN_GGUF}
    assert dataclasses.replace(loaded.config, **unset) == hf.config
    assert loaded.weights.keys() == hf.weights.keys()
    for name, w in hf.weights.items():
        if raw and name in ("layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.0.v_proj.weight"):
            # through Q8_0 (its dequantized codes are the weight); each part keeps its rows' codes
            torch.testing.assert_close(loaded.weights[name], w.float(), atol=w.abs().max().item() / 100, rtol=0)
            assert loaded.quantized[name].shape == tuple(w.shape)
        else:
            assert torch.equal(loaded.weights[name], w.float()), name


@pytest.mark.parametrize("original", [16, 256])
def test_a_phi3_gguf_with_longrope_factor_tensors_rotates_as_its_hf_folder(tmp_path, original):
    """llama.cpp writes LongRoPE's factors as tensors and the original context and attention factor
    as metadata: read back, they choose the same set (long past 16 of 256, short at 256) and give
    the same frequencies and attention factor as the Hugging Face config."""
    hf = load_hf_folder(write_hf_folder(build_hf_model("phi3", original_max_position_embeddings=original),
                                        tmp_path / "hf"))
    tensors = gguf_tensors(hf.weights, FAMILIES["phi3"])
    loaded = load_gguf(write_family_gguf(tmp_path / "m.gguf", "phi3", hf.config, tensors)).config
    want, got = hf.config.rope_scaling, loaded.rope_scaling
    assert got["factors"] == want["factors"] == ("long" if original == 16 else "short")
    rotary = hf.config.rotary_dim
    assert torch.equal(rope_inv_freq(rotary, loaded.rope_theta, got), rope_inv_freq(rotary, hf.config.rope_theta, want))
    assert rope_attention_factor(got) == pytest.approx(rope_attention_factor(want), rel=1e-6)

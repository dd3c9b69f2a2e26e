"""The family registry (models/families): which families it lists, the one sentence an unknown
architecture gets (from the API and as exit 1 through `llmc compile`, HF and GGUF alike), and that a
new family is its module: one registered in-test is loaded and traced with no other code touched."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import pytest

from llmc.compiler.frontend import trace
from llmc.models import families
from llmc.models.blocks import CausalLM
from llmc.models.config import ModelError
from llmc.models.families import FAMILIES, family_for_gguf, family_for_hf, register
from llmc.models.families.family import Family
from llmc.models.families import llama
from llmc.models.gguf_loader import load_gguf
from llmc.models.hf_loader import config_from_hf, load_hf_folder
from test_bad_inputs import assert_cli_error, assert_one_sentence, cli

FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2")


def test_registry_lists_the_families_and_what_they_answer_to():
    assert tuple(FAMILIES) == FAMILY_NAMES
    for name, arch, model_type in zip(FAMILY_NAMES, ARCHITECTURES, MODEL_TYPES):
        assert family_for_hf({"architectures": [arch]}) == (FAMILIES[name], arch)
        assert family_for_hf({"model_type": model_type}) == (FAMILIES[name], arch)  # no `architectures`
    for name in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"):
        assert family_for_gguf(name) is FAMILIES[name]
    assert [f.name for f in FAMILIES.values() if f.gguf_permuted_qk] == ["llama"]


RAW = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
       "num_attention_heads": 2, "max_position_embeddings": 64}


def test_family_config_choices():
    """qwen2 always has Q/K/V biases; a sliding window turned on caps the length of the families
    that attend fully (llama, qwen2, qwen3) and slides every layer of mistral's and phi3's."""
    raw = RAW | {"sliding_window": 16}
    cfg = {arch: config_from_hf(raw | {"architectures": [arch]}) for arch in
           ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")}
    assert [c.qkv_bias for c in cfg.values()] == [False, False, True, False, False]
    assert [c.max_position_embeddings for c in cfg.values()] == [16, 64, 16, 16, 64]
    assert [c.layer_types for c in cfg.values()] == [(), ("sliding_attention",) * 2, (), (), ("sliding_attention",) * 2]
    off = config_from_hf(raw | {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False})
    assert off.max_position_embeddings == 64


GEMMA3_1B = RAW | {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7, "head_dim": 4,
                   "query_pre_attn_scalar": 256, "sliding_window": 512}


def test_gemma3_config_in_either_rope_form():
    """transformers 5.x's per-layer-type `rope_parameters` and 4.x's `rope_local_base_freq` give one
    config: 5 sliding layers to 1 full by default, the local base on sliding layers, unscaled."""
    new = GEMMA3_1B | {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    old = GEMMA3_1B | {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    a, b = config_from_hf(new), config_from_hf(old)
    assert a == b
    assert a.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (a.rope_of(0), a.rope_of(5)) == ((1e4, None), (1e6, {"rope_type": "linear", "factor": 8.0}))
    assert (a.qk_norm, a.hidden_act, a.embed_scale, a.scale, a.tie_word_embeddings) == ("head", "gelu_tanh", True, 1 / 16, True)
    assert a.max_position_embeddings == 64                                   # the window does not cap it


def test_gemma2_alternates_and_soft_caps():
    cfg = config_from_hf(RAW | {"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4, "head_dim": 4,
                                "query_pre_attn_scalar": 144, "sliding_window": 8, "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0})
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.qk_norm, cfg.scale) == (50.0, 30.0, "", 144 ** -0.5)


def test_a_config_missing_a_field_the_family_needs_is_one_sentence(llama_folder, tmp_path):
    raw = {k: v for k, v in GEMMA3_1B.items() if k != "query_pre_attn_scalar"}
    with pytest.raises(ModelError) as info:
        config_from_hf(raw)
    assert_one_sentence(str(info.value), "'query_pre_attn_scalar'", "Gemma3ForCausalLM")
    (llama_folder / "config.json").write_text(json.dumps(raw))
    assert_cli_error(cli("compile", llama_folder, "-o", tmp_path / "out"), "'query_pre_attn_scalar'")


@pytest.fixture
def llama_folder(tiny_family, tmp_path) -> Path:
    """A copy of the tiny llama_gqa HF folder, free to edit."""
    return Path(shutil.copytree(tiny_family("llama_gqa")[1], tmp_path / "hf"))


def _set_architecture(folder: Path, **fields) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("fields, named", [
    ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel'"),
    ({"architectures": [], "model_type": "gpt2"}, "model_type 'gpt2'"),
], ids=["architectures", "model_type"])
def test_unknown_hf_architecture_names_the_families(llama_folder, tmp_path, fields, named):
    _set_architecture(llama_folder, **fields)
    words = (named, "not supported", *FAMILY_NAMES, *ARCHITECTURES)
    with pytest.raises(ModelError) as info:
        load_hf_folder(llama_folder)
    assert_one_sentence(str(info.value), *words)
    assert_cli_error(cli("compile", llama_folder, "-o", tmp_path / "out"), *words)
    assert not (tmp_path / "out").exists()


def test_unknown_gguf_architecture_names_the_families(tmp_path):
    path = tmp_path / "g.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")  # the architecture is all the loader reads first
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    words = ("GGUF architecture 'gpt2'", "not supported", *FAMILY_NAMES, "'llama'", "'qwen2'", "'gemma3'", "'olmo2'")
    with pytest.raises(ModelError) as info:
        load_gguf(path)
    assert_one_sentence(str(info.value), *words)
    assert_cli_error(cli("compile", path, "-o", tmp_path / "out"), *words)


VARIANT = Family(name="llama_variant", hf_architectures=("LlamaVariantForCausalLM",),
                 hf_model_types=("llama_variant",), config_from_hf=llama.config_from_hf, causal_lm=CausalLM)


def test_a_family_registered_in_a_test_is_loaded_and_traced(llama_folder, monkeypatch):
    """A Llama variant under a new architecture name: one Family, registered, and the HF loader,
    the config check and the frontend take it; its weights and graph are llama's."""
    monkeypatch.setattr(families, "FAMILIES", dict(FAMILIES))
    original = load_hf_folder(llama_folder)
    _set_architecture(llama_folder, architectures=["LlamaVariantForCausalLM"])
    with pytest.raises(ModelError, match="'LlamaVariantForCausalLM' in config.json is not supported"):
        load_hf_folder(llama_folder)

    register(VARIANT)
    variant = load_hf_folder(llama_folder)
    assert variant.config == dataclasses.replace(original.config, architecture="LlamaVariantForCausalLM")
    assert variant.weights.keys() == original.weights.keys()
    assert all(variant.weights[k].equal(w) for k, w in original.weights.items())
    assert str(trace(variant.config, "decode")) == str(trace(original.config, "decode"))
    assert "llama_variant (LlamaVariantForCausalLM)" in families.supported()


def test_register_refuses_a_taken_name_or_architecture(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", dict(FAMILIES))
    for clash in (dataclasses.replace(VARIANT, name="llama"),
                  dataclasses.replace(VARIANT, hf_architectures=("Qwen2ForCausalLM",))):
        with pytest.raises(ValueError, match="clashes"):
            register(clash)
    with pytest.raises(ValueError, match="names no GGUF architecture"):
        dataclasses.replace(VARIANT, gguf_permuted_qk=True)


def test_a_malformed_longrope_config_is_one_sentence():
    raw = RAW | {"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}
    with pytest.raises(ModelError) as info:
        config_from_hf(raw)
    assert_one_sentence(str(info.value), "LongRoPE", "long_factor")

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

FAMILY_NAMES = ("llama", "mistral", "qwen2")


def test_registry_lists_the_three_families_and_what_they_answer_to():
    assert tuple(FAMILIES) == FAMILY_NAMES
    for name, arch in zip(FAMILY_NAMES, ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")):
        assert family_for_hf({"architectures": [arch]}) == (FAMILIES[name], arch)
        assert family_for_hf({"model_type": name}) == (FAMILIES[name], arch)  # no `architectures`
    assert family_for_gguf("llama") is FAMILIES["llama"] and family_for_gguf("qwen2") is FAMILIES["qwen2"]
    assert FAMILIES["llama"].gguf_permuted_qk and not FAMILIES["qwen2"].gguf_permuted_qk


def test_family_config_choices():
    """qwen2 always has Q/K/V biases; a sliding window turned on caps the length (every family, as
    before the registry)."""
    raw = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "max_position_embeddings": 64, "sliding_window": 16}
    cfg = {arch: config_from_hf(raw | {"architectures": [arch]})
           for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")}
    assert [c.qkv_bias for c in cfg.values()] == [False, False, True]
    assert [c.max_position_embeddings for c in cfg.values()] == [16, 16, 16]
    off = config_from_hf(raw | {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False})
    assert off.max_position_embeddings == 64


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
    words = (named, "not supported", *FAMILY_NAMES, "LlamaForCausalLM", "Qwen2ForCausalLM")
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
    words = ("GGUF architecture 'gpt2'", "not supported", *FAMILY_NAMES, "'llama'", "'qwen2'")
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

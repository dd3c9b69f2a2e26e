"""GGUF pass-through: Q8_0/Q4_0/Q4_1 blocks become llmc's int8/int4 weights with the file's codes
and scales, bit for bit against gguf-py's own dequantization, through loading (Q/K rows
unpermuted), merging (QKV, gate/up) and compiling."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.kernels.quant import dequantize_weight
from llmc.models.gguf_loader import load_gguf
from test_gguf_loader import HEADS, KV_HEADS, hf_to_gguf_permute, hf_weights, tiny_vocab, write_gguf

Q = gguf.GGMLQuantizationType
TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0}


@pytest.fixture
def quantized_gguf(tmp_path):
    """A tiny llama GGUF whose GEMM weights are stored as Q4_0, Q4_1 and Q8_0 blocks (Q/K rows
    permuted first, then quantized, as llama.cpp's converter does)."""
    weights = hf_weights(np.random.default_rng(1), vocab=len(tiny_vocab()[0]))
    raw = {name: qtype for name in weights for part, qtype in TYPES.items() if f".{part}." in name}
    for name in weights:
        if ".attn_q." in name or ".attn_k." in name:
            weights[name] = hf_to_gguf_permute(weights[name], HEADS if ".attn_q." in name else KV_HEADS)
    tensors = {name: gguf.quants.quantize(w, raw[name]) if name in raw else w for name, w in weights.items()}
    return write_gguf(tmp_path / "q.gguf", tensors, raw_types=raw)


def test_kept_blocks_dequantize_bit_for_bit_like_gguf_py(quantized_gguf):
    model = load_gguf(quantized_gguf)
    sources = {name: qw.source for name, qw in model.quantized.items()}
    assert sources["layers.0.q_proj.weight"] == "Q4_0" and sources["layers.1.o_proj.weight"] == "Q8_0"
    assert len(model.quantized) == 2 * len(TYPES)
    for name, qw in model.quantized.items():
        assert torch.equal(qw.dequantize(), model.weights[name]), name     # weights: gguf-py's dequantize


@pytest.mark.parametrize("quant, kept", [("int4-g64", "Q4"), ("int8", "Q8_0")])
def test_compiled_artifact_keeps_the_files_codes(quantized_gguf, tmp_path, quant, kept):
    model = load_gguf(quantized_gguf)
    out = compile_model(quantized_gguf, tmp_path / "art", CompileConfig(quant=QuantRecipe.parse(quant)))
    stored = load_file(str(out / "weights.safetensors"))
    report = json.loads((out / "report.json").read_text())["quantize_weights"]
    for name, how in report.items():
        if how.startswith("kept"):
            assert kept in how
            codes, scales = stored[f"{name}.codes"], stored[f"{name}.scales"]
            mins = stored.get(f"{name}.mins")
            bits = 4 if mins is not None else 8
            parts = [model.weights[p] for p in _parts(name)]
            assert torch.equal(dequantize_weight(codes, scales, mins, bits), torch.cat(parts)), name
        else:
            assert how.startswith(("requantized from", "quantized to"))
    kept_names = [n for n, how in report.items() if how.startswith("kept")]
    assert ("layers.0.qkv_proj.weight" in kept_names) == (quant != "int8")  # Q4_0 + Q4_1 + Q4_1 stack as int4
    assert ("layers.0.o_proj.weight" in kept_names) == (quant == "int8")


def _parts(merged: str) -> list[str]:
    prefix = merged.rsplit(".", 2)[0]
    if merged.endswith("qkv_proj.weight"):
        return [f"{prefix}.{p}_proj.weight" for p in "qkv"]
    if merged.endswith("gate_up_proj.weight"):
        return [f"{prefix}.{p}_proj.weight" for p in ("gate", "up")]
    return [merged]

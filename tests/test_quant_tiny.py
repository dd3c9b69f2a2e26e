"""Quantized artifacts of tiny random models of every family compute what transformers computes on
the weights their codes stand for: the passes, the artifact and the kernels add nothing beyond the
weights' own rounding. transformers is the independent reference; the dequantized weights are
copied into its modules (the merged QKV and gate/up rows split back into their projections; the
token embedding and LM head too, which the quantized recipes quantize by default)."""

from __future__ import annotations

import copy

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.kernels.quant import dequantize_weight
from llmc.runtime.artifact import load_artifact
from test_parity_tiny import assert_matches_transformers
from tiny_models import FAMILIES

CASES = [(family, "int8") for family in FAMILIES] + [("llama_hd32", "int4-g32")]


def dequantized(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    mins = weights.get(f"{name}.mins")
    return dequantize_weight(weights[f"{name}.codes"], weights[f"{name}.scales"], mins, 4 if mins is not None else 8)


def model_on_dequantized_weights(model, weights: dict[str, torch.Tensor]):
    """A copy of the transformers model whose projections hold the artifact's dequantized weights."""
    model = copy.deepcopy(model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    widths = [cfg.num_attention_heads * head_dim, *[cfg.num_key_value_heads * head_dim] * 2]
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = dequantized(weights, f"layers.{i}.qkv_proj.weight")
            gate_up = dequantized(weights, f"layers.{i}.gate_up_proj.weight")
            if hasattr(attn, "qkv_proj"):                   # Phi-3 keeps them fused, as llmc's merge does
                pairs = [(attn.qkv_proj, qkv), (mlp.gate_up_proj, gate_up)]
            else:
                pairs = [*zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv.split(widths)),
                         *zip((mlp.gate_proj, mlp.up_proj), gate_up.chunk(2))]
            pairs += [(attn.o_proj, dequantized(weights, f"layers.{i}.o_proj.weight")),
                      (mlp.down_proj, dequantized(weights, f"layers.{i}.down_proj.weight"))]
            for module, w in pairs:
                module.weight.copy_(w)
        tables = (("embed_tokens.weight", model.model.embed_tokens), ("lm_head.weight", model.lm_head))
        for name, module in tables:        # quantized by default; a tied LM head shares the embedding's
            if f"{name}.codes" in weights:
                module.weight.copy_(dequantized(weights, name))
    return model


@pytest.mark.parametrize("kernels", ["reference", "native"])
@pytest.mark.parametrize("family, quant", CASES)
def test_quantized_artifact_matches_transformers_on_its_dequantized_weights(tiny_family, tmp_path, family, quant,
                                                                            kernels):
    model, folder, _ = tiny_family(family)
    artifact = compile_model(folder, tmp_path / "art", CompileConfig(quant=QuantRecipe.parse(quant)))
    weights = load_artifact(artifact).weights
    assert weights["layers.0.down_proj.weight.codes"].dtype == (torch.int8 if quant == "int8" else torch.uint8)
    reference = model_on_dequantized_weights(model, weights)
    moved = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert moved > 0                                    # the weights really were rounded
    assert_matches_transformers(reference, artifact, kernels)

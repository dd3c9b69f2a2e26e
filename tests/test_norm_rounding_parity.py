"""A tiny Gemma 3 and OLMo-2 in bf16 norm their first hidden states exactly as transformers' bf16
models do: the IR graph's first norm (interpreted) equals the transformers module's output (a
forward hook) bit for bit, and the same graph traced with Llama's rounding does not. Layer 0's
input norm for Gemma 3 (embeddings times sqrt(64) = 8, exact in bf16), the q norm over the row
for OLMo-2 (q_proj of the embeddings). Gemma's norm weights are multiples of 1/64 here, so that
transformers' fp32 multiplier 1 + w is a bf16 value too (llmc rounds 1 + w to the artifact's
dtype: module docstring of compiler/ops/norms.py). The compiled bf16 artifact keeps the rounding
through the passes, into add_rmsnorm and rope_kv_write.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.frontend import trace
from llmc.models.loader import load_model
from llmc.runtime.torch_backend import TorchProgram
from tiny_models import build_hf_model, write_hf_folder

BF16 = torch.bfloat16
# family -> (llmc's weight of the first norm, transformers' module of it)
FIRST_NORM = {"gemma3": ("layers.0.attn_norm.weight", "model.layers.0.input_layernorm"),
              "olmo2": ("layers.0.q_norm.weight", "model.layers.0.self_attn.q_norm")}


def hf_bf16(family: str):
    model = build_hf_model(family)
    if family == "gemma3":
        with torch.no_grad():          # w on a 1/64 grid: 1 + w (in [1.5, 2.5]) is a bf16 value
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_((p * 64).round() / 64)
    return model


def first_norm_of_graph(cfg, weights: dict, ids: torch.Tensor, weight_name: str) -> torch.Tensor:
    """The traced bf16 prefill graph of `cfg`, interpreted on one sequence: its norm of `weight_name`."""
    graph = trace(cfg, "prefill", "bf16")
    node = next(n for n in graph.nodes if n.op in ("rmsnorm", "head_rmsnorm")
                and any(v.node == f"w.{weight_name}" for v in n.inputs))
    feeds = {"input_ids": ids, "positions": torch.arange(ids.numel()),
             "query_start_loc": torch.tensor([0, ids.numel()], dtype=torch.int32),
             "logits_indices": torch.tensor([ids.numel() - 1])}
    with torch.inference_mode():
        return TorchProgram(graph, {k: v.to(BF16) for k, v in weights.items()}).values(feeds)[node.value()]


@pytest.mark.parametrize("family", list(FIRST_NORM))
def test_bf16_first_norm_is_transformers_bit_for_bit(family, tmp_path):
    model = hf_bf16(family)
    loaded = load_model(write_hf_folder(model, tmp_path / "hf"))
    assert loaded.config.norm_rounding == "product"
    ids = torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(0))
    weight_name, module_name = FIRST_NORM[family]
    seen = []
    hf = model.to(BF16)
    hook = hf.get_submodule(module_name).register_forward_hook(lambda m, i, out: seen.append(out))
    with torch.no_grad():
        hf(ids[None])
    hook.remove()
    want = seen[0].reshape(ids.numel(), -1)                                # [T, width]
    got = first_norm_of_graph(loaded.config, loaded.weights, ids, weight_name)
    assert got.dtype == BF16 and torch.equal(got, want)
    llama = dataclasses.replace(loaded.config, norm_rounding="normed")
    other = first_norm_of_graph(llama, loaded.weights, ids, weight_name)
    assert (other != want).float().mean() > 0.05


@pytest.mark.parametrize("family", list(FIRST_NORM))
def test_the_bf16_artifact_keeps_the_rounding(family, tmp_path):
    folder = write_hf_folder(hf_bf16(family), tmp_path / "hf")
    artifact = compile_model(folder, tmp_path / "artifact", CompileConfig(dtype="bfloat16"))
    text = (artifact / "prefill.ir").read_text()
    norms = [line for line in text.splitlines() if "rmsnorm(" in line]
    assert norms and all("rounding='product'" in line for line in norms)
    fused = [line for line in text.splitlines() if "rope_kv_write(" in line]
    assert fused and all("norm_rounding='product'" in line for line in fused)

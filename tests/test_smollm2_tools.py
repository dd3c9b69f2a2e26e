"""The debugging tools on the real embedded SmolLM2-135M-Instruct: a compile with --dump-ir
writes one file per pass, `llmc ir --format onnx` passes the ONNX checker, the decode graph has a
handful of ops per layer, and bisect finds no pass that changes the model's greedy output."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmc.passes.pipeline import pass_names
from llmc.tools.cli import app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2_tools")
    result = CliRunner().invoke(app, ["compile", "-o", str(root / "artifact"), "--dump-ir", str(root / "ir")])
    assert result.exit_code == 0, result.output
    return root / "artifact", root / "ir"


def test_dump_ir_has_one_file_per_pass_and_the_report_a_handful_of_ops_per_layer(compiled):
    artifact, ir_dir = compiled
    want = ["00_traced.ir"] + [f"{i:02d}_{name}.ir" for i, name in enumerate(pass_names(), 1)]
    for entry in ("prefill", "decode"):
        assert sorted(p.name for p in (ir_dir / entry).iterdir()) == want
    report = json.loads((artifact / "report.json").read_text())
    assert report["ops_per_layer"] == {"prefill": 9, "decode": 9}
    assert report["op_counts"]["decode"]["rope_kv_write"] == 30


def test_ir_as_onnx_passes_the_checker(compiled, tmp_path):
    onnx = pytest.importorskip("onnx")
    artifact, _ = compiled
    out = tmp_path / "decode.onnx"
    result = CliRunner().invoke(app, ["ir", str(artifact), "--graph", "decode", "--format", "onnx", "-o", str(out)])
    assert result.exit_code == 0, result.output
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert len(model.graph.node) == 30 * 9 + 3  # + embedding, final add_rmsnorm, lm_head


def test_bisect_finds_no_diverging_pass_and_the_same_greedy_tokens():
    from llmc.models.loader import load_model
    from llmc.tools.bisect import bisect

    report = bisect(load_model(None), "SmolLM2", steps=8)
    assert report.culprit is None, report.render()
    assert report.greedy[0].first_flip is None


def smollm2_cut(layers: int, vocab: int):
    """The embedded SmolLM2 with only its first `layers` layers and `vocab` tokens: every layer
    kernel's real shapes and weights, at a fraction of the work the Triton interpreter has to do
    (the full model's LM head alone took it three minutes)."""
    import dataclasses

    from llmc.models.loader import load_model

    model = load_model(None)
    model.config = dataclasses.replace(model.config, num_layers=layers, vocab_size=vocab)
    model.weights = {name: w[:vocab] if name in ("embed_tokens.weight", "lm_head.weight") else w
                     for name, w in model.weights.items()
                     if not name.startswith("layers.") or int(name.split(".")[1]) < layers}
    return model


def test_every_unit_of_smollm2_lowers_to_a_kernel_and_one_decode_step_matches(compiled, tmp_path, monkeypatch):
    """The cuda target on the real model: every fusion group of both graphs has a generated kernel,
    and one decode step over a short context (run in Triton's interpreter here) of its first layer
    and 2048 tokens (every layer kernel's shapes, real weights) gives the torch executor's logits."""
    import torch

    from llmc.compiler import driver
    from llmc.compiler.codegen import lower
    from llmc.runtime.artifact import load_artifact

    artifact, _ = compiled
    lowering = lower(load_artifact(artifact).graphs)
    for entry, graph in load_artifact(artifact).graphs.items():
        groups = {n.attrs["group"] for n in graph.nodes if "group" in n.attrs}
        assert groups <= {u.group for u in lowering.units[entry]}
        assert len(lowering.plan[entry]) == len(lowering.units[entry])
    monkeypatch.setattr(driver, "load_model", lambda source: smollm2_cut(1, 2048))
    for target in ("cpu", "cuda"):
        result = CliRunner().invoke(app, ["compile", "-o", str(tmp_path / target), "--target", target])
        assert result.exit_code == 0, result.output
    from test_triton_executor import run_backend   # the tiny models' steps, with one decode
    from tolerances import tolerance

    got, want = run_backend(tmp_path / "cuda", "triton", 1), run_backend(tmp_path / "cpu", "torch", 1)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance(torch.float32, 1536, scale=16.0))

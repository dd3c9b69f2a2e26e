"""`llmc debug bisect` names exactly the pass that broke a model: planted wrong rewrites (an
epsilon off by 1e-3, gate and up swapped) are found, the node and error reported; a clean
pipeline passes, with greedy tokens equal to the traced graph's."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from llmc.models.loader import load_model
from llmc.passes import pipeline
from llmc.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from llmc.passes.merge_gate_up import merge_gate_up
from llmc.passes.pipeline import PIPELINE, Pass
from llmc.tools.bisect import bisect, tolerance
from llmc.tools.cli import app

FAMILY = "llama_gqa"


def eps_off_by_a_little(graph, ctx):
    """fuse_add_rmsnorm with a planted bug: the fused norm's epsilon is 1e-3 too large."""
    graph = fuse_add_rmsnorm(graph, ctx)
    for node in graph.nodes:
        if node.op == "add_rmsnorm":
            node.attrs["eps"] += 1e-3
    return graph


def gate_and_up_swapped(graph, ctx):
    """merge_gate_up with a planted bug: the merged weight holds up before gate."""
    graph = merge_gate_up(graph, ctx)
    for node in graph.nodes:
        if node.op == "concat" and "gate_proj" in node.inputs[0].node:
            node.inputs = node.inputs[::-1]
    return graph


def plant(monkeypatch, name: str, run) -> None:
    patched = [Pass(p.name, run, p.summary, p.required) if p.name == name else p for p in PIPELINE]
    monkeypatch.setattr(pipeline, "PIPELINE", patched)


@pytest.fixture(scope="module")
def model(tiny_family):
    return load_model(tiny_family(FAMILY)[1])


def test_clean_pipeline_has_no_culprit_and_the_same_greedy_tokens(model):
    report = bisect(model, FAMILY, steps=6)
    assert report.culprit is None
    assert [c.stage.name for c in report.checks[:len(PIPELINE) + 1]] == ["traced"] + [p.name for p in PIPELINE]
    assert all(not c.diverged for c in report.checks)
    (greedy,) = report.greedy
    assert greedy.stage == "fusion_grouping" and greedy.first_flip is None and len(greedy.tokens) == 6
    assert "no pass changes the logits" in report.render()


@pytest.mark.parametrize("name, bug, before, after", [
    ("fuse_add_rmsnorm", eps_off_by_a_little, "= rmsnorm(", "= add_rmsnorm("),
    ("merge_gate_up", gate_and_up_swapped, "gate_proj.weight", "= split("),
])
def test_bisect_names_exactly_the_pass_with_the_planted_bug(monkeypatch, model, name, bug, before, after):
    plant(monkeypatch, name, bug)
    report = bisect(model, FAMILY, steps=6)
    culprit = report.culprit
    assert culprit is not None and culprit.check.stage.name == name
    assert before in culprit.node_before and after in culprit.node_after
    assert culprit.node_error > culprit.node_tolerance
    assert culprit.check.error > culprit.check.tolerance
    earlier = [c for c in report.checks if c.stage.index < culprit.check.stage.index]
    assert earlier and not any(c.diverged for c in earlier)
    assert report.greedy[0].stage == name
    assert f"first divergence: pass {name} changes the logits" in report.render()


def test_the_cli_reports_the_culprit_and_exits_1(monkeypatch, tiny_family):
    plant(monkeypatch, "fuse_add_rmsnorm", eps_off_by_a_little)
    result = CliRunner().invoke(app, ["debug", "bisect", str(tiny_family(FAMILY)[1]), "--steps", "4"])
    assert result.exit_code == 1, result.output
    assert "first divergence: pass fuse_add_rmsnorm" in result.stdout
    assert "greedy decode of the chat prompt after fuse_add_rmsnorm" in result.stdout


def test_tolerance_grows_with_dtype_reduction_and_magnitude():
    base = tolerance("f32", 64, 1.0)
    assert tolerance("bf16", 64, 1.0) == base * 2.0**16
    assert tolerance("f32", 256, 1.0) == base * 2
    assert tolerance("f32", 64, 10.0) == base * 10
    assert tolerance("f32", 64, 0.01) == base  # magnitudes below 1 count as 1

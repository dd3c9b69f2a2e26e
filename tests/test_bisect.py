"""`llmc debug bisect` names exactly the pass that broke a model, in every dtype and after
lowering: planted wrong rewrites (an epsilon off by 1e-3, gate and up swapped, RoPE theta off
by 1%, the attention scale off by 1%, the KV slot off by one, K and V swapped in the fused
write) are found, the pass, node and error reported; a clean pipeline passes, with greedy tokens
equal to the traced graph's."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from llmc.compiler import ops
from llmc.kernels.attention import kv_write_ref
from llmc.models.loader import load_model
from llmc.passes import pipeline
from llmc.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from llmc.passes.fuse_rope_kv_write import fuse_rope_kv_write
from llmc.passes.insert_paged_attention import insert_paged_attention
from llmc.passes.merge_gate_up import merge_gate_up
from llmc.passes.pipeline import PIPELINE, Pass
from llmc.tools.bisect import FACTOR, bisect, tolerance
from llmc.tools.cli import app

FAMILY = "llama_gqa"
DTYPES = ["float32", "bfloat16", "float16"]


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


def rope_theta_off_by_1_percent(graph, ctx):
    graph = fuse_rope_kv_write(graph, ctx)
    for node in graph.nodes:
        if node.op == "rope_kv_write":
            node.attrs["theta"] *= 1.01
    return graph


def attention_scale_off_by_1_percent(graph, ctx):
    graph = insert_paged_attention(graph, ctx)
    for node in graph.nodes:
        if node.op in ("paged_attention", "paged_decode_attention"):
            node.attrs["scale"] *= 1.01
    return graph


def kv_slot_off_by_one(graph, ctx):
    """The lowering emits a KV write that stores every token one slot too far."""
    graph = insert_paged_attention(graph, ctx)
    for node in graph.nodes:
        if node.op == "kv_write":
            node.op = "kv_write_off_by_one"
    return graph


def k_and_v_swapped(graph, ctx):
    """The fused write stores V as K and K as V (unpacked q, k, v: merge_qkv disabled)."""
    graph = fuse_rope_kv_write(graph, ctx)
    for node in graph.nodes:
        if node.op == "rope_kv_write":
            q, k, v, *rest = node.inputs
            node.inputs = (q, v, k, *rest)
    return graph


@pytest.fixture
def off_by_one_op(monkeypatch):
    """A test-only op: kv_write with the slot off by one (what kv_slot_off_by_one emits)."""
    off_by_one = dataclasses.replace(ops.OPS["kv_write"], name="kv_write_off_by_one", reference=lambda x, a: kv_write_ref(
        x.kv_cache, x.k, x.v, (x.slot_mapping + 1) % slots(x.kv_cache), a["layer"]))
    monkeypatch.setitem(ops.OPS, "kv_write_off_by_one", off_by_one)


def slots(kv_cache) -> int:
    return kv_cache.shape[2] * kv_cache.shape[4]      # blocks x block size


def plant(monkeypatch, name: str, run) -> None:
    patched = [Pass(p.name, run, p.summary, p.required) if p.name == name else p for p in PIPELINE]
    monkeypatch.setattr(pipeline, "PIPELINE", patched)


@pytest.fixture(scope="module")
def model(tiny_family):
    return load_model(tiny_family(FAMILY)[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_clean_pipeline_has_no_culprit_and_the_same_greedy_tokens(model, dtype):
    report = bisect(model, FAMILY, dtype=dtype, steps=6)
    assert report.culprit is None, report.render()
    assert [c.stage.name for c in report.checks[:len(PIPELINE) + 1]] == ["traced"] + [p.name for p in PIPELINE]
    assert all(not c.diverged for c in report.checks)
    assert all(c.error > 0 for c in report.checks)       # the float64 truth is not the run itself
    (greedy,) = report.greedy
    assert greedy.stage == "fusion_grouping" and len(greedy.tokens) == 6
    assert dtype != "float32" or greedy.first_flip is None
    assert "no pass changes the logits" in report.render()


def assert_names(report, name: str, before: str, after: str) -> None:
    culprit = report.culprit
    assert culprit is not None and culprit.check.stage.name == name, report.render()
    assert culprit.node_before is not None, report.render()
    assert before in culprit.node_before and after in culprit.node_after, report.render()
    assert culprit.node_error > culprit.node_tolerance
    assert culprit.check.error > culprit.check.tolerance
    earlier = [c for c in report.checks if c.stage.index < culprit.check.stage.index]
    assert earlier and not any(c.diverged for c in earlier)
    assert report.greedy[0].stage == name
    assert f"first divergence: pass {name} changes the logits" in report.render()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, bug, before, after", [
    ("fuse_add_rmsnorm", eps_off_by_a_little, "= rmsnorm(", "= add_rmsnorm("),
    ("merge_gate_up", gate_and_up_swapped, "gate_proj.weight", "= split("),
])
def test_bisect_names_the_pass_with_a_planted_bug_in_every_dtype(monkeypatch, model, dtype, name, bug, before, after):
    plant(monkeypatch, name, bug)
    assert_names(bisect(model, FAMILY, dtype=dtype, steps=4), name, before, after)


@pytest.mark.parametrize("name, bug, before, after, disabled", [
    ("fuse_rope_kv_write", rope_theta_off_by_1_percent, "= rope(", "= rope_kv_write(", ()),
    ("insert_paged_attention", attention_scale_off_by_1_percent, "= attention(", "= paged_attention(", ()),
    ("insert_paged_attention", kv_slot_off_by_one, "= attention(", "= paged_attention(", ()),
    ("fuse_rope_kv_write", k_and_v_swapped, "= paged_attention(", "= paged_attention(", ("merge_qkv",)),
])
def test_bisect_names_the_pass_with_a_planted_bug_after_lowering(monkeypatch, off_by_one_op, model, name, bug,
                                                                 before, after, disabled):
    plant(monkeypatch, name, bug)
    report = bisect(model, FAMILY, steps=4, disabled=disabled)
    assert_names(report, name, before, after)
    at_culprit = {c.probe: c for c in report.checks if c.stage == report.culprit.check.stage}
    assert at_culprit["decode, context"].diverged     # a decode over real context sees every one of them


def test_the_cli_reports_the_culprit_and_exits_1(monkeypatch, tiny_family):
    plant(monkeypatch, "fuse_add_rmsnorm", eps_off_by_a_little)
    result = CliRunner().invoke(app, ["debug", "bisect", str(tiny_family(FAMILY)[1]), "--steps", "4"])
    assert result.exit_code == 1, result.output
    assert "first divergence: pass fuse_add_rmsnorm" in result.stdout
    assert "greedy decode of the chat prompt after fuse_add_rmsnorm" in result.stdout


def test_tolerance_is_a_factor_over_the_dtypes_own_error_with_an_epsilon_floor():
    assert tolerance("bf16", 0.1, 1.0) == FACTOR * 0.1
    assert tolerance("f32", 0.0, 8.0) == FACTOR * 8.0 * 2.0**-23
    assert tolerance("bf16", 0.0, 8.0) == tolerance("f32", 0.0, 8.0) * 2.0**16

"""`llmc debug bisect --tp N`: the shard pass and its collectives are bisected like any pass. From the
shard pass on, every stage's N ranks run in lockstep in one process (tools/bisect_ranks.py), rank 0's
logits against the same float64 truth and tolerance rule as every stage. A clean pipeline is not
flagged at --tp 2 and 3 (the ranks' partial sums only reorder fp32 rounding; also SmolLM2's 9 query and
3 KV heads); a shard pass that skips an all_reduce or gives a rank another rank's KV head is named."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from llmc.compiler.frontend import trace
from llmc.models.config import LoadedModel
from llmc.models.loader import load_model
from llmc.passes import pipeline, shard as shard_module
from llmc.passes.pipeline import PIPELINE, Pass
from llmc.tools.bisect import Culprit, bisect
from llmc.tools.cli import app

STAGES = ["traced"] + [p.name for p in PIPELINE]


def plant(monkeypatch, run) -> None:
    patched = [Pass(p.name, run, p.summary, p.required) if p.name == "shard" else p for p in PIPELINE]
    monkeypatch.setattr(pipeline, "PIPELINE", patched)


def skip_first_all_reduce(graph, ctx):
    """The shard pass with a planted bug: layer 0's attention output is not summed over the ranks."""
    graph = shard_module.shard(graph, ctx)
    first = next(n for n in graph.nodes if n.op == "all_reduce")
    for node in graph.nodes:
        node.inputs = tuple(first.inputs[0] if v == first.value() else v for v in node.inputs)
    graph.outputs = tuple(first.inputs[0] if v == first.value() else v for v in graph.outputs)
    return graph


def kv_heads_of_the_next_rank(graph, ctx):
    """The shard pass with a planted bug: its plan gives rank r layer 0's K and V rows of head r + 1
    (mod the heads), through a copy of the merged weight with those rows rolled by one head."""
    graph = shard_module.shard(graph, ctx)
    rules, name = ctx.records["shard"]["weights"], "layers.0.qkv_proj.weight"
    rule = rules[name]
    q, k, v = rule["sizes"]
    head = k // rule["units"][1]
    w = ctx.weights[name]
    rolled = torch.cat([w[:q], w[q:q + k].roll(-head, 0), w[q + k:].roll(-head, 0)])
    ctx.weights[name + ".planted"] = rolled
    rules[name] = dict(rule, source=name + ".planted")
    return graph


@pytest.fixture(scope="module")
def gqa(tiny_family):
    return load_model(tiny_family("llama_gqa")[1])          # 6 heads, 3 KV heads


@pytest.fixture(scope="module")
def smollm2_heads(gqa):
    """SmolLM2's head layout (9 query heads, 3 KV heads, tied embeddings) at tiny widths, seeded weights."""
    config = dataclasses.replace(gqa.config, hidden_size=72, num_heads=9, num_kv_heads=3, head_dim=8,
                                 tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)
    weights = {n.name[2:]: torch.rand(n.type.shape, generator=g) + 0.5 if "norm" in n.name
               else torch.randn(n.type.shape, generator=g) * 0.3 for n in trace(config, "prefill").weights()}
    return LoadedModel(config, weights, gqa.tokenizer)


@pytest.mark.parametrize("family, tp, dtype", [("gqa", 3, "float32"), ("smollm2_heads", 3, "float32"),
                                                ("gqa", 3, "bfloat16")])
def test_a_clean_sharded_pipeline_is_not_flagged(request, family, tp, dtype):
    report = bisect(request.getfixturevalue(family), family, dtype=dtype, steps=3, tp=tp)
    assert report.culprit is None, report.render()
    assert [c.stage.name for c in report.checks[:len(STAGES)]] == STAGES
    sharded = [c for c in report.checks if c.stage.ranks is not None]
    assert {c.stage.name for c in sharded} == {"shard", "fusion_grouping"}
    assert all(c.stage.ranks.plan.size == tp and c.error > 0 for c in sharded)
    assert dtype != "float32" or report.greedy[0].first_flip is None
    assert f"{tp} ranks in lockstep" in report.render()


def test_tp_2_on_a_model_of_even_heads_is_not_flagged(tiny_family):
    report = bisect(load_model(tiny_family("llama_hd32")[1]), "llama_hd32", steps=3, tp=2)     # 4 heads, 2 KV
    assert report.culprit is None, report.render()
    assert report.checks[-1].stage.ranks.plan.size == 2


def test_a_skipped_all_reduce_is_named(monkeypatch, gqa):
    plant(monkeypatch, skip_first_all_reduce)
    report = bisect(gqa, "llama_gqa", steps=3, tp=3)
    culprit = report.culprit
    assert culprit is not None and culprit.check.stage.name == "shard", report.render()
    assert not any(c.diverged for c in report.checks if c.stage.index < culprit.check.stage.index)
    assert "first divergence: pass shard changes the logits" in report.render()
    assert "= all_reduce(" in culprit.node_after and "layers.0." in culprit.node_before, report.render()
    assert report.greedy[0].stage == "shard" and report.greedy[0].first_flip is not None
    unmatched = dataclasses.replace(report, culprit=Culprit(culprit.check)).render()
    assert "no value all 3 ranks hold whole differs before the logits" in unmatched


def test_another_ranks_kv_head_is_named_at_the_first_value_every_rank_holds(monkeypatch, gqa):
    plant(monkeypatch, kv_heads_of_the_next_rank)
    report = bisect(gqa, "llama_gqa", steps=3, tp=3)
    culprit = report.culprit
    assert culprit is not None and culprit.check.stage.name == "shard", report.render()
    assert culprit.node_after is not None and "= all_reduce(" in culprit.node_after, report.render()
    assert "= linear(" in culprit.node_before and "o_proj" in culprit.node_before, report.render()
    assert culprit.node_error > culprit.node_tolerance


@pytest.mark.parametrize("tp, words", [("4", "--tp 4 does not divide the model's 6 attention heads"),
                                       ("0", "--tp 0 is not a rank count; give 1 or more")])
def test_the_cli_refuses_a_tp_the_heads_or_ranks_do_not_allow(tiny_family, tp, words):
    result = CliRunner().invoke(app, ["debug", "bisect", str(tiny_family("llama_gqa")[1]), "--tp", tp,
                                      "--steps", "0"])
    assert result.exit_code == 1, result.output
    assert words in result.output and "Traceback" not in result.output

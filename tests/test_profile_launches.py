"""`llmc profile`'s GEMM time by weight: launches name the weights they take in both programs (a
step plan and op by op), a role gathers every layer's GEMM of one weight and nothing else, its
bytes are those weights' stored bytes, and time known to be spent in one role's GEMMs is counted
there."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from llmc.compiler.ops import OPS
from llmc.runtime.artifact import load_artifact
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.slot_program import LaunchTime
from llmc.tools.profile_launches import flop_lines, gemm_by_weight, mean_by_weight, weight_lines, weight_role
from llmc.tools.profile_steps import prefill_flops, profile_decode, profile_prefill

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYER_ROLES = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def gemm_weight_bytes(art) -> int:
    """Stored bytes of every weight a GEMM of the decode graph takes, counted from the graph."""
    return sum(art.weights[v.node[2:]].numel() * art.weights[v.node[2:]].element_size()
               for n in art.graphs["decode"].nodes if OPS[n.op].kind == "gemm"
               for v in n.inputs if v.node.startswith("w."))


def test_a_role_is_the_weights_name_without_its_layer_and_parts():
    assert weight_role("layers.12.o_proj.weight.scales") == "o_proj"
    assert weight_role("layers.0.gate_up_proj.weight") == "gate_up_proj"
    assert weight_role("lm_head.weight") == "lm_head"
    assert weight_role("embed_tokens.weight.codes") == "embed_tokens"


@pytest.mark.parametrize("step_plans", [True, False])
@pytest.mark.parametrize("family, lm_head", [("llama_hd32", "lm_head"), ("llama_tied", "embed_tokens (tied LM head)")])
def test_every_gemm_is_in_one_role_with_its_stored_bytes(tiny_family, family, lm_head, step_plans):
    engine = Engine(tiny_family(family)[2], EngineConfig(backend_options={"step_plans": step_plans,
                                                                           "cuda_graphs": False}))
    art, layers = engine.artifact, engine.artifact.config.num_layers
    by_weight = profile_decode(engine, 2)[0].by_weight
    assert set(by_weight) == LAYER_ROLES | {lm_head}
    assert all(by_weight[role]["launches"] == layers for role in LAYER_ROLES) and by_weight[lm_head]["launches"] == 1
    assert sum(row["bytes"] for row in by_weight.values()) == gemm_weight_bytes(art)
    assert all(row["seconds"] > 0 for row in by_weight.values())


def test_a_prefills_rows_count_each_gemms_flops_over_its_rows(tiny_family):
    """2 x tokens x N x K a layer GEMM (its stored [N, K] weight), 2 x 1 x N x K the LM head (one row
    after the logits gather): the rows add up to the profile's GEMM FLOPs."""
    engine = Engine(tiny_family("llama_hd32")[2], EngineConfig(backend_options={"cuda_graphs": False}))
    art, tokens = engine.artifact, 24
    by_weight = profile_prefill(engine, tokens).by_weight
    for role, row in by_weight.items():
        numel = sum(w.numel() for name, w in art.weights.items() if name.endswith(f"{role}.weight"))
        assert row["flops"] == 2 * (1 if role == "lm_head" else tokens) * numel, role
    cfg = art.config
    attention = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) // 2
    assert sum(row["flops"] for row in by_weight.values()) + attention == prefill_flops(art.graphs["prefill"], art,
                                                                                         tokens)


O_PROJ_DELAY = 0.02        # seconds added to every o_proj launch (the tiny model's decode step: ~1 ms)


def test_time_spent_in_one_roles_gemms_is_counted_there(tiny_family, monkeypatch):
    """Every o_proj launch (op by op: the one linear whose weight is [hidden, hidden]) is made
    O_PROJ_DELAY longer: o_proj's row must hold layers x delay, and no other row half a delay."""
    hidden, linear = load_artifact(tiny_family("llama_hd32")[2]).config.hidden_size, OPS["linear"].reference

    def slowed(x, attrs):
        if tuple(x.weight.shape) == (hidden, hidden):
            time.sleep(O_PROJ_DELAY)
        return linear(x, attrs)

    monkeypatch.setitem(OPS, "linear", dataclasses.replace(OPS["linear"], reference=slowed))
    engine = Engine(tiny_family("llama_hd32")[2], EngineConfig(backend_options={
        "kernels": "reference", "step_plans": False, "cuda_graphs": False}))
    by_weight = profile_decode(engine, 2)[0].by_weight
    added = O_PROJ_DELAY * engine.artifact.config.num_layers
    assert by_weight["o_proj"]["seconds"] >= added
    assert all(row["seconds"] < O_PROJ_DELAY / 2 for role, row in by_weight.items() if role != "o_proj"), by_weight


def test_a_step_groups_layers_and_the_mean_averages_steps():
    def gemm(name, seconds):
        return LaunchTime("qlinear", "gemm", seconds, weights=(f"{name}.weight.codes", f"{name}.weight.scales"))

    sizes = {f"layers.{i}.o_proj.weight.{p}": 100 for i in range(2) for p in ("codes", "scales")}
    sizes |= {"embed_tokens.weight.codes": 1000, "embed_tokens.weight.scales": 50, "norm.weight": 8}
    stored = {name: torch.empty(n, dtype=torch.uint8) for name, n in sizes.items()}
    launches = [LaunchTime("qembedding", "data_movement", 0.5, weights=("embed_tokens.weight.codes",)),
                gemm("layers.0.o_proj", 1.0), LaunchTime("rmsnorm", "rowwise", 0.5, weights=("norm.weight",)),
                gemm("layers.1.o_proj", 2.0), gemm("embed_tokens", 4.0)]
    step = gemm_by_weight(launches, stored)
    assert step == {"o_proj": {"launches": 2, "seconds": 3.0, "bytes": 400, "flops": 0},
                    "embed_tokens (tied LM head)": {"launches": 1, "seconds": 4.0, "bytes": 1050, "flops": 0}}
    slower = {role: {**row, "seconds": 2 * row["seconds"]} for role, row in step.items()}
    assert mean_by_weight([step, slower])["o_proj"] == {"launches": 2, "seconds": 4.5, "bytes": 400, "flops": 0}
    flops = {"layers.0.o_proj.weight.codes": 7, "layers.1.o_proj.weight.codes": 9, "embed_tokens.weight.codes": 5}
    assert gemm_by_weight(launches, stored, flops)["o_proj"]["flops"] == 16


def test_the_lines_put_the_slowest_first_against_the_paired_rate():
    by_weight = {"o_proj": {"launches": 30, "seconds": 0.0002, "bytes": 6_000_000},
                 "gate_up_proj": {"launches": 30, "seconds": 0.001, "bytes": 40_000_000}}
    head, slowest, faster = weight_lines(by_weight, paired_rate=50e9)
    assert head.startswith("    GEMM/GEMV by weight in a timed step")
    assert slowest.split() == ["gate_up_proj", "x30", "1.00", "ms", "40.0", "MB", "40.0", "GB/s", "80%"]
    assert faster.split() == ["o_proj", "x30", "0.20", "ms", "6.0", "MB", "30.0", "GB/s", "60%"]
    assert weight_lines({}, 50e9) == []


def test_the_prefills_lines_put_the_slowest_first_against_the_matmul_peak():
    by_weight = {"o_proj": {"launches": 30, "seconds": 0.05, "bytes": 0, "flops": 10_000_000_000},
                 "gate_up_proj": {"launches": 30, "seconds": 0.25, "bytes": 0, "flops": 50_000_000_000}}
    head, slowest, faster = flop_lines(by_weight, peak=250e9)
    assert head.startswith("    GEMMs by weight")
    assert slowest.split() == ["gate_up_proj", "x30", "250.0", "ms", "50.00", "GFLOP", "200.0", "GFLOP/s", "80%"]
    assert faster.split() == ["o_proj", "x30", "50.0", "ms", "10.00", "GFLOP", "200.0", "GFLOP/s", "80%"]
    assert flop_lines({}, 250e9) == []

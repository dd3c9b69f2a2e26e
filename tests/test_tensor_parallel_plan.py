"""The shard plan (compiler/tensor_parallel.py) and a --tp artifact: the cut rules on integers, the
plan through the manifest, the loader checking each weight's rank shape through the plan, `llmc
inspect` showing it, and the compile refusals as one sentence (CLI exit 1, in process: a spawned
`llmc` per refusal would cost seconds of import each)."""

from __future__ import annotations

import json

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.tensor_parallel import TensorParallelPlan, cut, cut_shape, rank_weights, replicate, segments, split
from llmc.models.config import ModelError
from llmc.runtime.artifact import ArtifactError, load_artifact
from llmc.tools.inspect import artifact_summary
from test_bad_inputs import assert_cli_error, cli

ROWS = torch.arange(12).view(12, 1)         # row i holds i


def rows(t: torch.Tensor) -> list[int]:
    return t[:, 0].tolist()


def test_split_gives_each_rank_its_equal_part_as_a_view():
    parts = [cut(ROWS, split(0), 3, r) for r in range(3)]
    assert [rows(p) for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(p.data_ptr() == ROWS[4 * r].data_ptr() for r, p in enumerate(parts))
    assert cut(ROWS, replicate(), 3, 1) is ROWS


def test_segments_give_each_rank_its_heads_of_q_k_and_v():
    qkv = segments(0, [8, 2, 2], [4, 1, 1])               # 4 q heads of 2 rows, 1 KV head: replicated
    assert [rows(cut(ROWS, qkv, 2, r)) for r in range(2)] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 8, 9, 10, 11]]
    gqa = segments(0, [4, 4, 4], [4, 4, 4])               # 4 q heads, 4 KV heads of one row: one each of 4 ranks
    assert [rows(cut(ROWS, gqa, 4, r)) for r in range(4)] == [[r, 4 + r, 8 + r] for r in range(4)]
    assert cut_shape((12, 1), qkv, 2) == (8, 1)


def test_fewer_kv_heads_than_ranks_go_to_the_ranks_whose_query_heads_read_them():
    qkv = segments(0, [4, 2, 2], [4, 2, 2])               # 4 q heads, 2 KV heads (q heads 0,1 read KV 0)
    kv_rows = [rows(cut(ROWS[:8], qkv, 4, r))[1:] for r in range(4)]
    assert kv_rows == [[4, 6], [4, 6], [5, 7], [5, 7]]


def test_a_rule_the_ranks_cannot_share_is_a_value_error():
    with pytest.raises(ValueError, match="does not split into 5 equal parts"):
        cut(ROWS, split(0), 5, 0)
    with pytest.raises(ValueError, match="3 units cannot be shared by 2 ranks"):
        cut(ROWS, segments(0, [6, 3, 3], [6, 3, 3]), 2, 0)


def test_the_plan_round_trips_through_the_manifest_and_cuts_from_a_source():
    plan = TensorParallelPlan(2, {"table.vocab_split": {**split(0), "source": "table"}, "table": replicate()})
    again = TensorParallelPlan.from_manifest(json.loads(json.dumps({"tensor_parallel": plan.to_manifest()})))
    assert again == plan and TensorParallelPlan.from_manifest({}).size == 1
    held = rank_weights({"table": ROWS}, plan.to_manifest(), 1)
    assert rows(held["table.vocab_split"]) == list(range(6, 12)) and held["table"] is ROWS
    with pytest.raises(ValueError, match="rank 2 is outside the 2 ranks"):
        plan.rank_weights({"table": ROWS}, 2)


@pytest.fixture(scope="module")
def sharded(tiny_family, tmp_path_factory):
    """(HF folder, a --tp 2 artifact) of the tiny Qwen3 (4 heads, 2 KV heads)."""
    _, folder, _ = tiny_family("qwen3")
    return folder, compile_model(folder, tmp_path_factory.mktemp("tp") / "qwen3_tp2", CompileConfig(tp=2))


def test_the_artifact_holds_one_full_copy_and_the_plan(sharded):
    _, path = sharded
    artifact = load_artifact(path)
    plan = TensorParallelPlan.from_manifest(artifact.manifest)
    assert plan.size == 2 and artifact.manifest["compile"]["tp"] == 2
    qkv = artifact.weights["layers.0.qkv_proj.weight"]                 # whole: 4 q + 2 k + 2 v heads of 32
    assert qkv.shape == (256, 64) and plan.rank_shape("layers.0.qkv_proj.weight", qkv.shape) == (128, 64)
    assert "%kv_cache = input() : f32[2,2,NB,1,BS,32]" in (path / "decode.ir").read_text()
    held = plan.rank_weights(artifact.weights, 1)
    assert torch.equal(held["layers.0.o_proj.weight"], artifact.weights["layers.0.o_proj.weight"][:, 64:])


def test_the_loader_checks_rank_shapes_through_the_plan(sharded, tmp_path):
    import shutil

    _, path = sharded
    broken = shutil.copytree(path, tmp_path / "broken")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["tensor_parallel"]["weights"]["layers.0.o_proj.weight"] = replicate()
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"weight 'layers.0.o_proj.weight' has shape \(64, 128\) on each of 2 "
                                            r"ranks but prefill.ir declares f32\[64,64\]; recompile"):
        load_artifact(broken)


def test_inspect_shows_the_plan(sharded):
    _, path = sharded
    text = artifact_summary(path)
    assert "tensor-par 2 ranks" in text
    assert "layers.*.o_proj.weight" in text and "split dim 1 in 2" in text
    assert "segments of dim 0: 128 (4 / 2) | 64 (2 / 2) | 64 (2 / 2)" in text


def test_draft_skip_with_tp_is_refused_in_one_sentence():
    with pytest.raises(ModelError, match="--draft-skip 1 cannot go with --tp 2: the draft graph is not sharded"):
        CompileConfig(tp=2, draft_skip=1)


def test_compile_with_a_tp_that_does_not_divide_the_heads_exits_1(sharded, tmp_path):
    folder, _ = sharded
    assert_cli_error(cli("compile", folder, "--tp", "3", "-o", tmp_path / "x"),
                     "--tp 3 does not divide the model's 4 attention heads", "choose a --tp that divides 4")


def test_compile_with_a_tp_that_cuts_quantization_groups_exits_1(tiny_family, tmp_path):
    _, folder, _ = tiny_family("llama_hd32")                # down_proj: 160 features, 5 groups of 32
    result = cli("compile", folder, "--tp", "2", "--quant", "int4-g32", "-o", tmp_path / "x")
    assert_cli_error(result, "--tp 2 would cut the quantization groups of layers.0.down_proj.weight",
                     "5 groups of 32")

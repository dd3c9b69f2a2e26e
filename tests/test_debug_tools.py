"""The pass-level debugging tools: `llmc passes`, `compile --dump-ir / --stop-after`,
`llmc ir` (text, dot, onnx), `llmc debug diff`, the report's per-pass records, and the
PassError a broken rewrite raises. (Bisect has its own file: test_bisect.py.)"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner, Result

from llmc.compiler.ir import Node, parse_graph
from llmc.compiler.ops import verify
from llmc.passes import pipeline
from llmc.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from llmc.passes.pipeline import PIPELINE, Pass, PassError, pass_names, run_pipeline
from llmc.passes.rewrite import PassContext, RewriteState, rewrite
from llmc.tools.cli import app
from llmc.tools.graph_export import GROUP_COLOURS

FAMILY = "llama_gqa"


def cli(*args) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def dumped(tiny_family, tmp_path_factory):
    """A tiny model compiled through the CLI with --dump-ir: (hf folder, artifact, dump dir)."""
    _, folder, _ = tiny_family(FAMILY)
    root = tmp_path_factory.mktemp("dumped")
    result = cli("compile", folder, "-o", root / "artifact", "--dump-ir", root / "ir")
    assert result.exit_code == 0, result.output
    return folder, root / "artifact", root / "ir"


def expected_files() -> list[str]:
    return ["00_traced.ir"] + [f"{i:02d}_{name}.ir" for i, name in enumerate(pass_names(), 1)]


# ------------------------------------------------------------------------- passes, dumps


def test_passes_lists_the_pipeline_one_line_per_pass():
    result = cli("passes")
    lines = result.stdout.strip().splitlines()
    assert result.exit_code == 0 and len(lines) == len(PIPELINE)
    for line, p in zip(lines, PIPELINE):
        assert p.name in line and p.summary in line
        assert ("(required)" in line) == p.required


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_dump_ir_writes_one_parseable_file_per_pass(dumped, entry):
    _, artifact, ir_dir = dumped
    files = sorted(p.name for p in (ir_dir / entry).iterdir())
    assert files == expected_files()
    for file in files:
        verify(parse_graph((ir_dir / entry / file).read_text()))
    assert (ir_dir / entry / files[-1]).read_text() == (artifact / f"{entry}.ir").read_text()


def test_report_records_every_pass_and_a_handful_of_ops_per_layer(dumped):
    _, artifact, _ = dumped
    report = json.loads((artifact / "report.json").read_text())
    for entry in ("prefill", "decode"):
        records = [r for r in report["passes"] if r["graph"] == entry]
        assert [r["name"] for r in records] == pass_names()
        assert all(r["seconds"] >= 0 and r["nodes_before"] > 0 for r in records)
        assert report["ops_per_layer"][entry] == 9  # was 17 before the fusions
    hits = {r["name"]: r["hits"] for r in report["passes"] if r["graph"] == "decode"}
    assert hits["merge_qkv"] == 6 and hits["fuse_rope_kv_write"] == 2 and hits["fuse_add_rmsnorm"] == 4
    assert report["layer_op_counts"]["decode"] == {  # the add_rmsnorms end the previous block
        "add_rmsnorm": 2, "linear": 4, "rope_kv_write": 1, "paged_decode_attention": 1, "silu_mul": 1}


def test_disabled_pass_leaves_a_gap_in_the_dump(tiny_family, tmp_path):
    _, folder, _ = tiny_family(FAMILY)
    result = cli("compile", folder, "-o", tmp_path / "a", "--dump-ir", tmp_path / "ir",
                 "--disable-pass", "fuse_add_rmsnorm", "--disable-pass", "cse")
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "ir" / "decode").iterdir())
    assert files == [f for f in expected_files() if "fuse_add_rmsnorm" not in f and "_cse" not in f]
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["compile"]["disabled_passes"] == ["fuse_add_rmsnorm", "cse"]


def test_stop_after_a_pass_before_lowering_writes_dumps_only(tiny_family, tmp_path):
    _, folder, _ = tiny_family(FAMILY)
    result = cli("compile", folder, "-o", tmp_path / "a", "--dump-ir", tmp_path / "ir", "--stop-after", "merge_qkv")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "ir" / "prefill").iterdir()) == expected_files()[:4]
    assert not (tmp_path / "a").exists()
    assert "no artifact" in one_line(result.stderr)


def test_stop_after_a_pass_before_lowering_without_dumps_is_refused(tiny_family, tmp_path):
    _, folder, _ = tiny_family(FAMILY)
    result = cli("compile", folder, "-o", tmp_path / "a", "--stop-after", "fuse_silu_mul")
    assert result.exit_code == 1
    message = one_line(result.stderr)
    assert "insert_paged_attention" in message and "--dump-ir" in message and "Traceback" not in result.output


def test_stop_after_lowering_writes_a_runnable_artifact(tiny_family, tmp_path):
    from llmc.runtime.artifact import load_artifact

    _, folder, _ = tiny_family(FAMILY)
    result = cli("compile", folder, "-o", tmp_path / "a", "--stop-after", "insert_paged_attention")
    assert result.exit_code == 0, result.output
    art = load_artifact(tmp_path / "a")
    assert "concat" in art.graphs["decode"].op_counts()  # fold_weights did not run: the runtime concats
    assert art.manifest["compile"]["stop_after"] == "insert_paged_attention"


# ---------------------------------------------------------------------------------- ir


def test_ir_of_an_artifact_prints_its_stored_graph(dumped):
    _, artifact, _ = dumped
    result = cli("ir", artifact, "--graph", "decode")
    assert result.exit_code == 0 and result.stdout == (artifact / "decode.ir").read_text()


@pytest.mark.parametrize("after", ["traced", "merge_qkv", "fuse_rope_kv_write"])
def test_ir_of_a_model_after_a_pass_equals_the_dump(dumped, after):
    folder, _, ir_dir = dumped
    result = cli("ir", folder, "--after", after, "--graph", "prefill")
    assert result.exit_code == 0, result.output
    (want,) = [p for p in (ir_dir / "prefill").iterdir() if p.stem.endswith("_" + after)]
    assert result.stdout == want.read_text()


def test_ir_dot_output_has_every_op_and_a_cluster_per_group(dumped):
    _, artifact, _ = dumped
    result = cli("ir", artifact, "--graph", "decode", "--format", "dot")
    text = result.stdout
    graph = parse_graph((artifact / "decode.ir").read_text())
    assert text.startswith('digraph "decode" {') and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    for node in graph.nodes:
        assert f'"{node.name}" [' in text
    edges = sum(len(n.inputs) for n in graph.nodes) + len(graph.outputs)
    assert text.count(" -> ") == edges
    groups = {n.attrs["group"] for n in graph.nodes if "group" in n.attrs}
    assert len(re.findall(r'subgraph "cluster_group_\d+"', text)) == len(groups) > 0
    for node in graph.nodes:                   # a group's ops share its fill colour; others have none
        fill = re.search(rf'"{node.name}" \[[^\n]*fillcolor="(#\w+)"', text)
        if "group" in node.attrs:
            assert fill and fill.group(1) == GROUP_COLOURS[node.attrs["group"] % len(GROUP_COLOURS)]
        elif node.op != "weight":
            assert fill is None


def test_ir_onnx_output_passes_the_onnx_checker(dumped, tmp_path):
    onnx = pytest.importorskip("onnx")
    folder, artifact, _ = dumped
    for source, extra in ((artifact, []), (folder, ["--after", "merge_gate_up"])):
        out = tmp_path / "g.onnx"
        result = cli("ir", source, "--graph", "prefill", "--format", "onnx", "-o", out, *extra)
        assert result.exit_code == 0, result.output
        model = onnx.load(str(out))
        onnx.checker.check_model(model, full_check=True)
        ops = [n for n in parse_graph(cli("ir", source, "--graph", "prefill", *extra).stdout).nodes
               if n.op not in ("input", "weight")]
        assert [n.op_type for n in model.graph.node] == [n.op for n in ops]
        assert {n.domain for n in model.graph.node} == {"llmc"}
        dims = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim}
        assert {"T", "S+1"} <= dims


def test_ir_onnx_needs_an_output_file(dumped):
    _, artifact, _ = dumped
    result = cli("ir", artifact, "--format", "onnx")
    assert result.exit_code == 2 and "-o" in result.output


def test_ir_after_on_an_artifact_is_refused_in_one_sentence(dumped):
    _, artifact, _ = dumped
    result = cli("ir", artifact, "--after", "dce")
    assert result.exit_code == 1 and "holds only the final IR" in one_line(result.stderr)


def test_ir_after_an_unknown_pass_names_the_passes(dumped):
    folder, _, _ = dumped
    result = cli("ir", folder, "--after", "fuse_everything")
    assert result.exit_code == 1
    assert "no pass named 'fuse_everything'" in one_line(result.stderr)


# -------------------------------------------------------------------------------- diff


def test_debug_diff_shows_op_count_changes_and_the_changed_lines(dumped):
    _, _, ir_dir = dumped
    a, b = ir_dir / "decode" / "04_merge_gate_up.ir", ir_dir / "decode" / "05_fuse_add_rmsnorm.ir"
    result = cli("debug", "diff", a, b)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[2] == "op counts: add_rmsnorm 0 -> 4 (+4); rmsnorm 5 -> 1 (-4)"
    removed = [ln for ln in lines if ln.startswith("- ")]
    added = [ln for ln in lines if ln.startswith("+ ")]
    assert len([ln for ln in removed if "= rmsnorm(" in ln]) == 4
    assert len([ln for ln in added if "= add_rmsnorm(" in ln]) == 4
    assert not any("= concat(" in ln for ln in removed + added)  # renumbering alone is no change


def test_debug_diff_of_a_file_with_itself_reports_no_change(dumped):
    _, _, ir_dir = dumped
    (f,) = (ir_dir / "prefill").glob("*_fusion_grouping.ir")
    result = cli("debug", "diff", f, f)
    assert "op counts: unchanged" in result.stdout and "no structural change" in result.stdout


# ----------------------------------------------------------------------- a broken pass


def _ill_typed_rule(node: Node, state: RewriteState):
    if node.op != "silu":
        return None
    x = state.get(node.inputs[0])
    return (state.emit("rmsnorm", [x, x], eps=1e-5).value(),)  # a [T,120] tensor as the norm weight


def _wrong_declared_type(graph, ctx):
    graph = fuse_add_rmsnorm(graph, ctx)
    node = next(n for n in graph.nodes if n.op == "add_rmsnorm")
    node.types = (node.types[0].with_shape("T", 71), node.types[1])
    return graph


@pytest.mark.parametrize("broken, words", [
    (lambda g, ctx: rewrite(g, [_ill_typed_rule], "fuse_silu_mul", ctx),
     ["pass 'fuse_silu_mul'", "rule _ill_typed_rule", "= silu(",
      "rmsnorm weight f32[T,120] does not match hidden size of f32[T,120]"]),
    (_wrong_declared_type, ["pass 'fuse_add_rmsnorm'", "= add_rmsnorm(", "declared type f32[T,71], f32[T,72] "
                            "but the add_rmsnorm rule gives f32[T,72], f32[T,72]"]),
], ids=["rule_emits_ill_typed_node", "pass_returns_wrong_type"])
def test_an_invalid_graph_stops_the_pipeline_naming_pass_node_and_rule(monkeypatch, tiny_family, broken, words):
    from llmc.compiler.frontend import trace
    from llmc.models.loader import load_config

    name = words[0].split("'")[1]
    patched = [Pass(p.name, broken, p.summary) if p.name == name else p for p in PIPELINE]
    monkeypatch.setattr(pipeline, "PIPELINE", patched)
    with pytest.raises(PassError) as info:
        run_pipeline(trace(load_config(tiny_family(FAMILY)[1]), "prefill"), PassContext())
    message = str(info.value)
    assert "\n" not in message
    for w in words:
        assert w in message, message


def test_an_invalid_graph_is_one_sentence_from_the_cli(monkeypatch, tiny_family, tmp_path):
    _, folder, _ = tiny_family(FAMILY)
    patched = [Pass(p.name, _wrong_declared_type, p.summary) if p.name == "fuse_add_rmsnorm" else p
               for p in PIPELINE]
    monkeypatch.setattr(pipeline, "PIPELINE", patched)
    result = cli("compile", folder, "-o", tmp_path / "a")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert one_line(result.stderr).startswith("error: pass 'fuse_add_rmsnorm' produced an invalid graph")

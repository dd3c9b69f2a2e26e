"""ONNX export of quantized graphs: a tiny Llama compiled with int8 weights (and an int8 KV cache)
and with int4 weights exports both entry graphs as models the ONNX checker passes, its integer
codes typed as what they are (i8 -> INT8; u4x2 -> UINT8 bytes that say they hold two codes; the token
table's codes are int8 under either recipe), and
`llmc ir ART --format onnx` writes them with exit status 0 (it died with KeyError: 'i8')."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from llmc.compiler.artifact_format import ENTRY_FILES
from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.ir import parse_graph
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.tools.cli import app
from llmc.tools.graph_export import to_onnx

onnx = pytest.importorskip("onnx")

FAMILY = "llama_hd32"          # widths a multiple of 32: int4-g32 fits every GEMM
RECIPES = {"int8": QuantRecipe.parse("int8", kv_dtype="int8"), "int4": QuantRecipe.parse("int4")}
CODES_TYPE = {"int8": onnx.TensorProto.INT8, "int4": onnx.TensorProto.UINT8}


@pytest.fixture(scope="module")
def quantized(tiny_family, tmp_path_factory):
    """recipe name -> artifact of the tiny model compiled with that recipe."""
    _, folder, _ = tiny_family(FAMILY)
    root = tmp_path_factory.mktemp("onnx_quant")
    return {name: compile_model(folder, root / name, CompileConfig(quant=recipe)) for name, recipe in RECIPES.items()}


@pytest.mark.parametrize("entry", list(ENTRY_FILES))
@pytest.mark.parametrize("quant", list(RECIPES))
def test_quantized_graphs_export_to_models_the_checker_passes(quantized, quant, entry):
    graph = parse_graph((quantized[quant] / ENTRY_FILES[entry]).read_text())
    model = to_onnx(graph)
    onnx.checker.check_model(model, full_check=True)
    codes = [i for i in model.graph.input if i.name.endswith(".codes")]
    tables = [i for i in codes if "embed_tokens" in i.name or "lm_head" in i.name]   # int8 for every recipe
    gemms = [i for i in codes if i not in tables]
    assert gemms and {i.type.tensor_type.elem_type for i in gemms} == {CODES_TYPE[quant]}
    assert tables and {i.type.tensor_type.elem_type for i in tables} == {onnx.TensorProto.INT8}
    assert all(("two 4-bit codes" in i.doc_string) == (quant == "int4" and i in gemms) for i in codes)
    cache = next(i for i in model.graph.input if i.name == "%kv_cache")
    assert cache.type.tensor_type.elem_type == (onnx.TensorProto.INT8 if quant == "int8" else onnx.TensorProto.FLOAT)


@pytest.mark.parametrize("quant", list(RECIPES))
def test_llmc_ir_writes_onnx_for_a_quantized_artifact(quantized, quant, tmp_path):
    out = tmp_path / "decode.onnx"
    result = CliRunner().invoke(app, ["ir", str(quantized[quant]), "--graph", "decode", "--format", "onnx",
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)

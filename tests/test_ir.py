"""The IR text round-trips, and verify / the parser reject broken graphs with messages that name
the node (its IR text) or the line, and the rule."""

from __future__ import annotations

import copy
import json

import pytest

from llmc.compiler.frontend import ENTRIES, trace
from llmc.compiler.ir import Graph, IRError, Node, TensorType, Value, format_node, parse_graph, print_graph
from llmc.compiler.ops import verify
from llmc.models.hf_loader import config_from_hf
from llmc.passes.pipeline import run_pipeline
from llmc.passes.rewrite import PassContext
from tiny_models import FAMILIES


def model_config(tiny_family, family: str):
    _, folder, _ = tiny_family(family)
    return config_from_hf(json.loads((folder / "config.json").read_text()))


@pytest.fixture(scope="module")
def prefill(tiny_family) -> Graph:
    """The traced (not yet lowered) prefill graph of a tiny GQA Llama."""
    return trace(model_config(tiny_family, "llama_gqa"), "prefill")


def first(graph: Graph, op: str) -> Node:
    return next(n for n in graph.nodes if n.op == op)


# ----------------------------------------------------------------------------- round trip


def assert_round_trips(graph: Graph) -> None:
    text = print_graph(graph)
    parsed = parse_graph(text)
    assert print_graph(parsed) == text
    assert parsed == graph  # same nodes, attrs and outputs, not only the same text
    verify(parsed)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("entry", ENTRIES)
def test_print_parse_print_is_identical_traced_and_lowered(tiny_family, family, entry):
    traced = trace(model_config(tiny_family, family), entry)
    assert_round_trips(traced)
    lowered, _ = run_pipeline(copy.deepcopy(traced), PassContext())
    assert "paged_attention" in print_graph(lowered) or "paged_decode_attention" in print_graph(lowered)
    assert_round_trips(lowered)


def test_multi_result_values_print_as_hash_index_and_parse_back():
    t, w = TensorType("f32", ("T", 8)), TensorType("f32", (8,))
    graph = Graph("multi", [
        Node("x", "input", (), {}, (t,)),
        Node("r", "input", (), {}, (t,)),
        Node("w.norm", "weight", (), {}, (w,)),
        Node("7", "add_rmsnorm", (Value("x"), Value("r"), Value("w.norm")), {"eps": 1e-05}, (t, t)),
        Node("8", "add", (Value("7"), Value("7", 1)), {}, (t,)),
    ], outputs=(Value("8"), Value("7", 1)))
    text = print_graph(graph)
    assert "%7 = add_rmsnorm(%x, %r, %w.norm, eps=1e-05) : f32[T,8], f32[T,8]" in text
    assert "%8 = add(%7, %7#1) : f32[T,8]" in text
    assert "return %8, %7#1" in text
    parsed = parse_graph(text)
    assert parsed == graph
    assert parsed.nodes[-1].inputs[1] == Value("7", 1)
    assert parsed.outputs[1] == Value("7", 1)
    assert print_graph(parsed) == text


# ----------------------------------------------------------------------------- verify


def broken(graph: Graph, edit) -> tuple[Graph, Node]:
    """A copy of `graph` with `edit(graph)` applied; edit returns the node it broke."""
    g = copy.deepcopy(graph)
    return g, edit(g)


def use_before_definition(g: Graph) -> Node:
    norm = first(g, "rmsnorm")
    g.nodes.remove(norm)
    g.nodes.insert(g.nodes.index(first(g, "embedding")), norm)  # before the value it reads
    return norm


def wrong_declared_type(g: Graph) -> Node:
    lin = first(g, "linear")
    lin.types = (lin.type.with_shape(lin.type.shape[0], lin.type.shape[1] + 1),)
    return lin


def unknown_op(g: Graph) -> Node:
    node = first(g, "silu")
    node.op = "frobnicate"
    return node


def wrong_arity(g: Graph) -> Node:
    lin = first(g, "linear")
    lin.inputs = lin.inputs[:1]
    return lin


def missing_attribute(g: Graph) -> Node:
    norm = first(g, "rmsnorm")
    del norm.attrs["eps"]
    return norm


def duplicate_name(g: Graph) -> Node:
    norms = [n for n in g.nodes if n.op == "rmsnorm"]
    norms[1].name = norms[0].name
    return norms[1]


VERIFY_CASES = {
    use_before_definition: "which is not defined before it",
    wrong_declared_type: "but the linear rule gives",
    unknown_op: "unknown op 'frobnicate'",
    wrong_arity: "linear takes (x, weight, bias?), got 1 inputs",
    missing_attribute: "rmsnorm is missing attribute(s) ['eps']",
    duplicate_name: "is defined twice",
}


@pytest.mark.parametrize("edit", list(VERIFY_CASES), ids=lambda f: f.__name__)
def test_verify_names_the_node_and_the_rule(prefill, edit):
    verify(prefill)  # the unbroken graph is fine
    graph, node = broken(prefill, edit)
    with pytest.raises(IRError) as info:
        verify(graph)
    message = str(info.value)
    assert VERIFY_CASES[edit] in message
    assert format_node(node) in message
    assert "\n" not in message


def test_verify_reports_the_wrong_type_and_the_rule_type(prefill):
    graph, node = broken(prefill, wrong_declared_type)
    with pytest.raises(IRError, match=r"declared type f32\[T,73\] but the linear rule gives f32\[T,72\]"):
        verify(graph)


def test_verify_catches_an_undefined_output(prefill):
    graph = copy.deepcopy(prefill)
    graph.outputs = (Value("nowhere"),)
    with pytest.raises(IRError, match="returns %nowhere, which is not defined"):
        verify(graph)


# ----------------------------------------------------------------------------- parser


def corrupt_line(text: str, pick, replace) -> tuple[str, str]:
    """Apply `replace` to the first line `pick` accepts; return the new text and the new line."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if pick(ln))
    lines[i] = replace(lines[i])
    return "\n".join(lines) + "\n", lines[i].strip()


PARSE_CASES = {
    "garbage_line": (lambda ln: "= linear(" in ln, lambda ln: "  this is not IR at all", "cannot parse"),
    "unknown_dtype": (lambda ln: "= linear(" in ln, lambda ln: ln.replace(": f32[", ": f99["), "f99"),
    "bad_attribute_literal": (lambda ln: "eps=1e-05" in ln, lambda ln: ln.replace("eps=1e-05", "eps=1e-05x"),
                              "attribute eps"),
}


@pytest.mark.parametrize("case", list(PARSE_CASES))
def test_parser_errors_name_the_line(prefill, case):
    pick, replace, words = PARSE_CASES[case]
    text, line = corrupt_line(print_graph(prefill), pick, replace)
    with pytest.raises(IRError) as info:
        parse_graph(text)
    message = str(info.value)
    assert words in message
    assert line in message
    assert "\n" not in message


def test_parser_rejects_text_without_graph_header_or_return():
    with pytest.raises(IRError, match="must start with 'graph NAME"):
        parse_graph("%0 = silu(%x) : f32[T,8]\n")
    with pytest.raises(IRError, match="has no 'return' line"):
        parse_graph("graph g {\n  %x = input() : f32[T,8]\n}\n")

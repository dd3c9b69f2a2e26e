"""An executor's CPU weights in one arena (runtime/weight_arena.py): equal values, one mapping in
the decode step's read order, page-aligned, an object under several names placed once, the
originals let go, and the clones it falls back to."""

from __future__ import annotations

import gc
import logging
import sys
import weakref

import pytest
import torch

from llmc.compiler.ir import parse_graph
from llmc.kernels.gemv import GemvWeight, prepare_linear_weight
from llmc.runtime import weight_arena
from llmc.runtime.weight_arena import PAGE, place_weights, read_order

GRAPH = """graph tiny {
  %ids = input() : i64[T]
  %w.table = weight() : f32[10,16]
  %w.proj = weight() : f32[8,16]
  %w.bias = weight() : f32[8]
  %0 = embedding(%w.table, %ids) : f32[T,16]
  %1 = linear(%0, %w.proj, %w.bias) : f32[T,8]
  %2 = linear(%0, %w.proj) : f32[T,8]
  %3 = add(%1, %2) : f32[T,8]
  return %3
}"""


def weights() -> dict:
    g = torch.Generator().manual_seed(0)
    proj = prepare_linear_weight(torch.randn(40, 16, generator=g))
    return {"bias": torch.randn(8, generator=g), "table": torch.randn(10, 16, generator=g),
            "proj": proj, "proj.alias": proj, "strided": torch.randn(6, 4, generator=g).t()}


def arena_tensors(placed: dict) -> list[torch.Tensor]:
    return [t for v in placed.values() for t in ([v.weight] if isinstance(v, GemvWeight) else [v])]


def test_placed_weights_equal_the_originals_in_one_page_aligned_arena():
    original = weights()
    placed = place_weights(original, ["table", "proj", "bias"])
    assert placed.keys() == original.keys()
    for name in ("bias", "table", "strided"):
        torch.testing.assert_close(placed[name], original[name], rtol=0, atol=0)
    torch.testing.assert_close(placed["proj"].weight, original["proj"].weight, rtol=0, atol=0)
    assert placed["proj"] is placed["proj.alias"]                   # held under two names, placed once
    assert placed["proj"].rows == original["proj"].rows
    in_arena = [placed[n] for n in ("table", "bias")] + [placed["proj"].weight]
    assert len({t.untyped_storage().data_ptr() for t in in_arena}) == 1
    assert all(t.data_ptr() % PAGE == 0 for t in in_arena)
    order = [placed["table"].data_ptr(), placed["proj"].weight.data_ptr(), placed["bias"].data_ptr()]
    assert order == sorted(order)                                   # the read order given
    assert placed["strided"].untyped_storage().data_ptr() != in_arena[0].untyped_storage().data_ptr()


def test_the_arena_keeps_none_of_the_originals():
    original = weights()
    watch = weakref.ref(original["table"])
    placed = place_weights(original)
    del original
    gc.collect()
    assert watch() is None and placed["table"].shape == (10, 16)


def test_read_order_is_the_order_of_the_nodes_that_read_them():
    assert read_order(parse_graph(GRAPH)) == ["table", "proj", "bias"]


def test_without_an_anonymous_mapping_the_weights_are_cloned(monkeypatch, caplog):
    def refuse(nbytes):
        raise OSError("no mapping")
    monkeypatch.setattr(weight_arena, "WeightArena", refuse)
    original = weights()
    with caplog.at_level(logging.INFO, logger="llmc"):
        placed = place_weights(original)
    assert "cloned one by one" in caplog.text
    assert placed["table"].data_ptr() != original["table"].data_ptr()
    torch.testing.assert_close(placed["table"], original["table"], rtol=0, atol=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_the_arena_asks_for_huge_pages_where_the_kernel_offers_them():
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    assert weight_arena.WeightArena(PAGE).huge_pages

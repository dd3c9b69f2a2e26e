"""tools/bench_gemv.py's row rescale: when the run's second floor sample is the higher one, every row's
fraction of the bandwidth is scaled to it, and a row saying why a path did not run (it has no fraction)
is printed as it is rather than crashing the benchmark (it did on a CPU without AVX512-BW)."""

from __future__ import annotations

from llmc.tools.bench_gemv import _rescale, _row


def test_a_measured_row_has_its_fraction_rescaled():
    row = _row("gate_up", "f32", "panels", 1e-4, 4_000_000, 50e9)
    assert row.endswith("80%")
    assert _rescale(row, 0.5).endswith("40%")
    assert _rescale(row, 0.5)[:-8] == row[:-8]


def test_a_row_without_a_fraction_is_kept_as_it_is():
    row = "lm_head  bf16         oneDNN packed: not on this CPU (bf16 needs AVX512-BW)"
    assert _rescale(row, 0.9) == row

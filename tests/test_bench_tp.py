"""`llmc bench-tp` on a tiny Llama (4 heads, 2 KV heads: TP 2 divides them), a few tokens and two requests:
a row per rank count, TP 1 measured though not asked for, the ratios to TP 1's figures of the same run,
the collectives' share of a sharded decode step (none at TP 1), and --artifacts read by their shard plans.
One real run, ~20 s (slow: rank 1 a local worker importing torch beside the command on 2 shared cores)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmc.runtime.sampling_params import RequestError
from llmc.tools.bench_tp import given_artifacts, parse_tp
from llmc.tools.cli import app
from test_bad_inputs import assert_one_sentence, error_line, run_llmc

FAMILY = "llama_hd32"


@pytest.mark.slow
def test_bench_tp_prints_a_row_per_rank_count_with_ratios_to_tp1(tiny_family, tmp_path):
    _, folder, _ = tiny_family(FAMILY)
    proc = run_llmc("bench-tp", folder, "--tp", "2", "--decode-tokens", "3", "--num-requests", "2", "--prompt-len",
                    "8:40", "--output-len", "4", "--work-dir", tmp_path, "--json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    one, two = result["runs"]["1"], result["runs"]["2"]
    assert one["collective_s"] == 0 and one["collective_share"] == 0      # one rank: no collective in its graph
    assert 0 < two["collective_s"] < two["timed_step_s"]
    assert two["collective_share"] == pytest.approx(two["collective_s"] / two["timed_step_s"])
    assert two["threads_per_rank"] == max(1, result["cores"] // 2)
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["1", "2"]
    assert rows[0][3] == rows[0][7] == rows[0][9] == "1.00x"
    assert rows[1][3] == f"{two['decode_s'] / one['decode_s']:.2f}x"
    assert rows[1][7] == f"{two['bench_output_tok_s'] / one['bench_output_tok_s']:.2f}x"
    assert rows[1][5] == f"{100 * two['collective_share']:.1f}%"
    assert given_artifacts(f"{two['artifact']},{one['artifact']}") == {1: tmp_path / "float32-tp1",
                                                                       2: tmp_path / "float32-tp2"}
    with pytest.raises(RequestError, match="no artifact compiled for one rank"):
        given_artifacts(two["artifact"])


def test_bench_tp_refuses_bad_rank_lists_in_one_sentence(tmp_path):
    assert parse_tp("3") == [1, 3] and parse_tp("2,1,2") == [1, 2]
    for args, words in [(["--tp", "1,two"], ("--tp '1,two'", "1,2")), (["--tp", "0"], ("--tp '0'", "1 or more")),
                        (["m", "--artifacts", "a"], ("not both",))]:
        result = CliRunner().invoke(app, ["bench-tp", *args, "--work-dir", str(tmp_path)])
        assert result.exit_code == 1, result.output
        assert_one_sentence(error_line(result.output).removeprefix("error: "), *words)

"""The GPU device check, run whole on a CPU with the torch backend standing in for triton: its
arguments, the random SmolLM2-shaped model builder, the comparisons and the closing table.
(On a GPU machine the same script compares triton + CUDA graphs against torch; see the README.)"""

from __future__ import annotations

import json

import pytest
import torch

from llmc.models.config import ModelConfig, expected_weights
from llmc.models.hf_loader import load_hf_folder
from llmc.tools import gpu_check
from llmc.tools.gpu_check_measure import first_divergence, resolution
from llmc.tools.gpu_check_model import hf_config, read_bundle, write_random_model
from llmc.tools.gpu_check_table import greedy_verdict, targets

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_random_model_has_every_weight_the_loader_expects(tiny_family, tmp_path):
    bundle = tiny_family("llama_tied")[1]
    folder = write_random_model(bundle, tmp_path / "model", seed=3)
    loaded = load_hf_folder(folder)
    assert set(loaded.weights) == set(expected_weights(loaded.config))
    assert loaded.config == read_bundle(bundle)
    again = load_hf_folder(write_random_model(bundle, tmp_path / "again", seed=3))
    assert all(torch.equal(loaded.weights[n], again.weights[n]) for n in loaded.weights)   # seeded


def test_smollm2_config_round_trips_through_the_hf_config():
    smollm2 = ModelConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0,
                          max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
    from llmc.models.hf_loader import config_from_hf
    assert config_from_hf(hf_config(smollm2)) == smollm2


def test_first_divergence_reports_the_step_and_the_reference_gap():
    want_logits = [torch.tensor([[0.0, 1.0, 0.5], [2.0, 0.0, 1.9]]), torch.tensor([[1.0, 0.0, 0.0], [0.0, 3.0, 2.995]])]
    rows = first_divergence([[1, 0], [0, 2]], [[1, 0], [0, 1]], want_logits, torch.bfloat16)
    assert rows[0] == {"prompt": 0, "identical": True, "tokens": 2}
    assert rows[1]["step"] == 1 and rows[1]["gap"] == pytest.approx(0.005, abs=1e-6)
    assert rows[1]["resolution"] == 2.0 ** -7 * 2          # bf16 spacing in [2, 4)
    assert resolution(1.0, torch.float16) == 2.0 ** -10
    assert "step 1" in greedy_verdict(rows) and "below the resolution" in greedy_verdict(rows)


def test_arguments_are_checked(capsys):
    for argv, words in ((["--bundle", "b", "--dtypes", "int4"], "'int4' is not one of"),
                        (["--bundle", "b", "--batches", "0"], "must be positive"),
                        (["--device", "cpu"], "--bundle is required")):
        with pytest.raises(SystemExit) as exc:
            gpu_check.parse_args(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err


def test_a_missing_bundle_file_is_one_sentence(tmp_path, capsys):
    assert gpu_check.main(["--bundle", str(tmp_path), "--device", "cpu", "--backend", "torch", "--bench", "none"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json" in err and "prepare" in err and "Traceback" not in err


def test_the_whole_check_runs_on_a_cpu_with_torch_standing_in(tiny_family, tmp_path, capsys):
    bundle = tiny_family("llama_gqa")[1]
    code = gpu_check.main([
        "--bundle", str(bundle), "--device", "cpu", "--backend", "torch", "--dtypes", "bfloat16,float16",
        "--batches", "1,2", "--decode-steps", "2", "--context", "8", "--greedy-tokens", "4", "--bench", "default",
        "--bench-requests", "3", "--bench-prompt-len", "8:16", "--bench-output-len", "3", "--hf", "static",
        "--work", str(tmp_path / "work"), "--json", str(tmp_path / "result.json")])
    table = capsys.readouterr().out
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    for dtype in ("bfloat16", "float16"):
        d = result["dtypes"][dtype]
        assert d["logits"]["max_abs_diff"] == 0.0 and d["logits"]["finite"]     # torch against torch
        assert all(r["identical"] for r in d["greedy"]) and len(d["greedy"]) == 3
        assert set(d["decode"]) == {"1", "2"} and all(t["eager"] > 0 and t["graphs"] is None
                                                      for t in d["decode"].values())
        assert d["floor"]["bytes"] > sum(w.numel() * 2 for w in load_hf_folder(bundle).weights.values()) // 2
    kernels = result["dtypes"]["bfloat16"]["kernels"]
    assert {k["kind"] for k in kernels} >= {"gemm", "attention"} and all(k["bytes"] > 0 for k in kernels)
    assert set(result["env"]["seconds"]) == {"dtypes bfloat16", "dtypes float16", "bench default"}
    bench = result["bench"]["default"]
    assert bench["llmc"]["output_tokens"] == 9 and bench["baselines"]["hf_static"]["output_tokens"] == 9
    for section in ("correctness", "decode step, ms", "bytes it must read", "kernels of one batch-1",
                    "llmc bench against transformers", "hf_static", "targets"):
        assert section in table, section
    assert table.rstrip().splitlines()[-1].startswith("  default workload >= 10x transformers")
    met = {name: ok for name, _, ok in targets(result)}
    assert met["fp16 greedy tokens identical to torch"] is True
    assert met["CUDA graphs cut batch-1 decode >= 3x"] is None       # nothing to capture on a CPU


def test_targets_and_table_from_a_gpu_shaped_result():
    """Known numbers in, known verdicts out: graphs 4x at batch 1, 1.5x the floor, 12x transformers."""
    from llmc.tools.gpu_check_table import format_table

    ms = lambda x: x / 1000  # noqa: E731
    dtype = lambda diverge: {  # noqa: E731
        "logits": {"max_abs_diff": 0.01, "tolerance": 0.1, "finite": True, "scale": 5.0},
        "greedy": [{"prompt": 0, "identical": True, "tokens": 32},
                   {"prompt": 1, "identical": False, "step": 9, "gap": 0.01, "resolution": 0.03}] if diverge
        else [{"prompt": p, "identical": True, "tokens": 32} for p in range(3)],
        "decode": {"1": {"eager": ms(8.0), "graphs": ms(2.0)}, "64": {"eager": ms(9.0), "graphs": ms(4.5)}},
        "floor": {"bytes": 270_000_000, "seconds": ms(4.0 / 3), "replay": ms(1.0)},
        "capture": {"batch_sizes": [1, 2, 4], "seconds": 3.5, "bytes": 2**29}, "graph_error": None,
        "kernels": [{"label": "template_linear_1234", "kind": "gemm", "launches": 120, "seconds": 1e-3,
                     "bytes": 200_000_000}]}
    result = {"env": {"device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
                      "transformers": "5.17", "date": "2026-12-01", "backend": "triton", "copy_bandwidth": 4e12},
              "dtypes": {"bfloat16": dtype(True), "float16": dtype(False)},
              "bench": {"default": {"llmc": {"output_tok_s": 12000.0, "ttft_s": {"p50": 0.1, "p99": 0.2},
                                             "tpot_s": {"p50": 0.01, "p99": 0.02}},
                                    "baselines": {"hf_static": {"output_tok_s": 1000.0},
                                                  "hf_continuous": {"error": "RuntimeError: no"}}}}}
    met = {name: (measured, ok) for name, measured, ok in targets(result)}
    assert met["fp16 greedy tokens identical to torch"][1] is True
    assert met["CUDA graphs cut batch-1 decode >= 3x"] == ("4.00x", True)
    assert met["batch-1 decode within 2x of the bytes floor"] == ("1.50x the floor (replay alone 0.75x)", True)
    assert met["default workload >= 10x transformers"] == ("12.0x", True)
    failed = {**result, "dtypes": {"bfloat16": {"error": "CompilationError: no"}, "float16": dtype(False)},
              "bench": {"default": {"error": "OutOfMemoryError: yes"}}}
    met_failed = {name: (measured, ok) for name, measured, ok in targets(failed)}
    assert met_failed["CUDA graphs cut batch-1 decode >= 3x"] == ("4.00x", True)      # from the fp16 part
    assert met_failed["default workload >= 10x transformers"] == ("not run", None)
    failed_table = format_table(failed)
    assert "bf16  FAILED: CompilationError: no" in failed_table and "default     FAILED: OutOfMemoryError" in failed_table
    table = format_table(result)
    for text in ("NVIDIA H200", "first at step 9 (prompt 1): logit gap 0.01, below the resolution 0.03",
                 "bf16 capture: 3 batch sizes in 3.5 s, 0.50 GiB", "graph replay alone 1.00 ms = 0.75x", "template_linear_1234", "200.0", "5.0%",
                 "unavailable: RuntimeError: no", "12.0x"):
        assert text in table, text


def test_the_parts_run_in_the_order_that_keeps_the_targets_first():
    args = gpu_check.parse_args(["--bundle", "b", "--dtypes", "bfloat16,float16", "--bench", "256,default"])
    assert gpu_check.plan(args) == [("dtypes", "bfloat16"), ("bench", "default"), ("dtypes", "float16"),
                                    ("bench", "256")]


def test_a_failing_part_is_recorded_and_a_user_error_still_stops_the_check(capsys):
    def broken():
        raise RuntimeError("triton: out of resources")
    assert gpu_check._part(broken) == {"error": "RuntimeError: triton: out of resources"}
    assert "Traceback" in capsys.readouterr().err

    def bad_request():
        raise gpu_check.RequestError("no")
    with pytest.raises(gpu_check.RequestError):
        gpu_check._part(bad_request)

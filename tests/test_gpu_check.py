"""The GPU device check, run whole on a CPU with the torch backend standing in for triton: its
arguments, the random SmolLM2-shaped model builder, the comparisons and the closing table.
(On a GPU machine the same script compares triton + CUDA graphs against torch; see the README.)"""

from __future__ import annotations

import json

import pytest
import torch

from llmc.models.config import ModelConfig, expected_weights
from llmc.models.hf_loader import load_hf_folder
from llmc.compiler.dtypes import USER_DTYPES
from llmc.tools import gpu_check, gpu_check_parts, gpu_check_run
from llmc.tools.gpu_check_correct import resolution
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


def test_the_option_names_are_the_compilers():
    assert gpu_check.DTYPE_NAMES == tuple(USER_DTYPES) and gpu_check.RECIPE_NAMES == tuple(gpu_check_parts.RECIPES)


def test_greedy_verdict_counts_picks_off_fp32s_top():
    rows = [{"prompt": 0, "tokens": 4, "off_top": 0, "worst_step": None, "worst_gap": 0.0, "tie": 0.1, "ok": True},
            {"prompt": 1, "tokens": 4, "off_top": 2, "worst_step": 3, "worst_gap": 0.05, "tie": 0.1, "ok": True}]
    assert greedy_verdict(rows) == "2/8 picks not fp32's top; worst gap 0.05 (prompt 1, step 3), within the tie 0.1"
    assert greedy_verdict(rows[:1]) == "all fp32's top (1 prompts x 4 tokens)"
    assert resolution(1.0, torch.float16) == 2.0 ** -10 and resolution(3.0, torch.bfloat16) == 2.0 ** -6


def test_arguments_are_checked(capsys):
    for argv, words in ((["--bundle", "b", "--dtypes", "int4"], "'int4' is not one of"),
                        (["--bundle", "b", "--batches", "0"], "must be positive"),
                        (["--bundle", "b", "--quant", "int3"], "'int3' is not one of"),
                        (["--bundle", "b", "--hf-timeout", "0"], "--hf-timeout 0 must be a positive"),
                        (["--device", "cpu"], "--bundle is required")):
        with pytest.raises(SystemExit) as exc:
            gpu_check.parse_args(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err


def test_a_missing_bundle_file_is_one_sentence(tmp_path, capsys):
    assert gpu_check.main(["--bundle", str(tmp_path), "--device", "cpu", "--backend", "torch", "--bench", "none"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json" in err and "prepare" in err and "Traceback" not in err


CPU_RUN = ["--device", "cpu", "--backend", "torch", "--batches", "1,2", "--decode-steps", "2", "--context", "8",
           "--greedy-tokens", "4", "--bench-requests", "3", "--bench-prompt-len", "8:16", "--bench-output-len", "3"]


def test_the_whole_check_runs_on_a_cpu_with_torch_standing_in(tiny_family, tmp_path, capsys):
    bundle = tiny_family("llama_hd32")[1]                  # hidden 128: int4's groups of 32 fit
    code = gpu_check.main(["--bundle", str(bundle), *CPU_RUN, "--dtypes", "bfloat16,float16", "--bench", "default",
                           "--hf", "static", "--work", str(tmp_path / "work"), "--json", str(tmp_path / "result.json")])
    table = capsys.readouterr().out
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    for name, d in {**result["dtypes"], **result["quant"]}.items():
        lg = d["logits"]
        assert lg["vs_torch"] == 0.0 and lg["candidate_error"] == lg["torch_error"] > 0 and lg["ok"], name
        assert lg["bound"] == 2 * lg["torch_error"] + lg["floor"] and lg["finite"]
        assert len(d["greedy"]) == 3 and all(r["ok"] for r in d["greedy"]) and d["greedy"] == d["greedy_torch"]
        assert set(d["decode"]) == {"1", "2"} and all(t["eager"] > 0 and t["graphs"] is None
                                                      for t in d["decode"].values())
    for d in result["dtypes"].values():
        assert d["floor"]["bytes"] > sum(w.numel() * 2 for w in load_hf_folder(bundle).weights.values()) // 2
    for name, q in result["quant"].items():
        quality = q["quality"]
        assert quality["ok"] and quality["kernels_delta_perplexity_percent"] == 0 and quality["positions"] == 511
        assert quality["mean_kl"] == quality["torch_mean_kl"] > 0 and quality["recipe_mean_kl"] > 0
        assert q["anchor"].endswith(f"artifact-anchor-{name}")
        assert quality["budget_percent"] == gpu_check_parts.RECIPES[name][1]
        assert quality["recipe"] == gpu_check_parts.RECIPES[name][0].to_dict()
    kernels = result["dtypes"]["bfloat16"]["kernels"]
    assert {k["kind"] for k in kernels} >= {"gemm", "attention"} and all(k["bytes"] > 0 for k in kernels)
    assert list(result["env"]["seconds"]) == ["anchor float32", "dtypes bfloat16", "bench default", "dtypes float16",
                                              "quant int8", "quant int4", "quant kv8"]
    bench = result["bench"]["default"]
    assert bench["llmc"]["output_tokens"] == 9 and bench["baselines"]["hf_static"]["output_tokens"] == 9
    assert "hf_continuous" not in bench["baselines"]                 # continuous only when asked
    for section in ("correctness", "fp32 anchor", "rule: ok when", "quantized recipes", "decode step, ms",
                    "bytes it must read", "kernels of one batch-1", "llmc bench against transformers", "hf_static",
                    "targets"):
        assert section in table, section
    assert table.rstrip().splitlines()[-1].startswith("  default workload >= 10x transformers")
    met = {name: ok for name, _, ok in targets(result)}
    assert met["fp16 greedy picks within fp32's near-ties"] is True
    assert met["fp16 logits within the fp32-anchored bound"] is True
    assert met["int4 kernels: logits, dppl within budget"] is True
    assert met["CUDA graphs cut batch-1 decode >= 3x"] is None       # nothing to capture on a CPU


def gpu_shaped_part(off_top: int = 0) -> dict:
    ms = lambda x: x / 1000  # noqa: E731
    return {
        "logits": {"candidate_error": 0.32, "torch_error": 0.30, "bound": 0.66, "ok": True, "finite": True},
        "greedy": [{"prompt": p, "tokens": 32, "off_top": off_top * p, "worst_step": 9 if off_top * p else None,
                    "worst_gap": 0.01 * off_top * p, "tie": 1.3, "ok": True} for p in range(3)],
        "greedy_torch": [{"prompt": p, "tokens": 32, "off_top": 0, "worst_step": None, "worst_gap": 0.0, "tie": 1.3,
                          "ok": True} for p in range(3)],
        "decode": {"1": {"eager": ms(8.0), "graphs": ms(2.0)}, "64": {"eager": ms(9.0), "graphs": ms(4.5)}},
        "floor": {"bytes": 270_000_000, "seconds": ms(4.0 / 3), "replay": ms(1.0)},
        "capture": {"batch_sizes": [1, 2, 4], "seconds": 3.5, "bytes": 2**29}, "graph_error": None,
        "kernels": [{"label": "template_linear_1234", "kind": "gemm", "launches": 120, "seconds": 1e-3,
                     "bytes": 200_000_000}]}


def test_targets_and_table_from_a_gpu_shaped_result():
    """Known numbers in, known verdicts out: graphs 4x at batch 1, 1.5x the floor, 12x transformers;
    the reviewer's fp16 figures (0.32 from fp32 where torch is 0.30) pass the anchored rule."""
    from llmc.tools.gpu_check_table import format_table

    int4 = {**gpu_shaped_part(), "quality": {"kernels_delta_perplexity_percent": 7.4, "budget_percent": 5.0,
                                             "delta_perplexity_percent": 7.9, "mean_kl": 0.03, "top1_agreement": 0.9,
                                             "torch_delta_perplexity_percent": 0.5, "torch_mean_kl": 0.001,
                                             "recipe_delta_perplexity_percent": 13.4, "recipe_mean_kl": 1.3,
                                             "dtype": "bfloat16", "ok": False, "positions": 511}}
    result = {"env": {"device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
                      "transformers": "5.17", "date": "2026-12-01", "backend": "triton", "copy_bandwidth": 4e12},
              "dtypes": {"bfloat16": gpu_shaped_part(2), "float16": gpu_shaped_part()}, "quant": {"int4": int4},
              "bench": {"default": {"llmc": {"output_tok_s": 12000.0, "ttft_s": {"p50": 0.1, "p99": 0.2},
                                             "tpot_s": {"p50": 0.01, "p99": 0.02}},
                                    "baselines": {"hf_static": {"output_tok_s": 1000.0},
                                                  "hf_continuous": {"error": "timed out after 300 s"}}}}}
    met = {name: (measured, ok) for name, measured, ok in targets(result)}
    assert met["fp16 logits within the fp32-anchored bound"] == ("0.32 <= 0.66", True)
    assert met["fp16 greedy picks within fp32's near-ties"][1] is True
    assert met["int4 kernels: logits, dppl within budget"] == ("logits ok, dppl +7.400% (<= 5%)", False)
    assert met["CUDA graphs cut batch-1 decode >= 3x"] == ("4.00x", True)
    assert met["batch-1 decode within 2x of the bytes floor"] == ("1.50x the floor (replay alone 0.75x)", True)
    assert met["default workload >= 10x transformers"] == ("12.0x", True)
    failed = {**result, "dtypes": {"bfloat16": {"error": "CompilationError: no"}, "float16": gpu_shaped_part()},
              "bench": {"default": {"error": "OutOfMemoryError: yes"}}}
    met_failed = {name: (measured, ok) for name, measured, ok in targets(failed)}
    assert met_failed["CUDA graphs cut batch-1 decode >= 3x"] == ("4.00x", True)      # from the fp16 part
    assert met_failed["default workload >= 10x transformers"] == ("not run", None)
    failed_table = format_table(failed)
    assert "bf16  FAILED: CompilationError: no" in failed_table
    assert "default     FAILED: OutOfMemoryError" in failed_table
    table = format_table(result)
    for text in ("NVIDIA H200", "6/96 picks not fp32's top; worst gap 0.04 (prompt 2, step 9), within the tie 1.3",
                 "bf16 capture: 3 batch sizes in 3.5 s, 0.50 GiB", "graph replay alone 1.00 ms = 0.75x",
                 "template_linear_1234", "200.0", "5.0%", "device time from CUDA events",
                 "int4      +7.400       5  NO     +7.900      0.03   0.900   +0.500"
                 "         +13.400 (OUTSIDE the budget)",
                 "within the tie 1.3; torch 0/96 off",
                 "unavailable: timed out after 300 s", "12.0x", "2 x torch's own"):
        assert text in table, text


def test_the_parts_run_in_the_order_that_keeps_the_targets_first():
    args = gpu_check.parse_args(["--bundle", "b", "--dtypes", "bfloat16,float16", "--bench", "256,default",
                                 "--quant", "kv8"])
    assert gpu_check_run.plan(args) == [("anchor", "float32"), ("dtypes", "bfloat16"), ("bench", "default"),
                                        ("dtypes", "float16"), ("quant", "kv8"), ("bench", "256")]


def test_a_failing_part_is_recorded_and_a_user_error_still_stops_the_check(capsys):
    def broken():
        raise RuntimeError("triton: out of resources")
    assert gpu_check_run._part(broken) == {"error": "RuntimeError: triton: out of resources"}
    assert "Traceback" in capsys.readouterr().err

    def bad_request():
        raise gpu_check_run.RequestError("no")
    with pytest.raises(gpu_check_run.RequestError):
        gpu_check_run._part(bad_request)


@pytest.mark.gpu
def test_kernel_times_on_a_gpu_come_from_events_with_one_sync_per_step(tiny_family, tmp_path, monkeypatch):
    """On a GPU: each kernel's device time from CUDA events, the device synchronised once a step
    (not after each launch), and the kernels' sum below the eager step's wall time."""
    from llmc.compiler.driver import CompileConfig, compile_model
    from llmc.runtime.artifact import load_artifact
    from llmc.runtime.model_runner import ModelRunner
    from llmc.tools.gpu_check_measure import decode_seconds, kernel_table

    artifact = load_artifact(compile_model(tiny_family("llama_hd32")[1], tmp_path / "cuda",
                                           CompileConfig(dtype="float16", target="cuda")))
    runner = ModelRunner.for_backend(artifact, 64, 16, "triton", {"cuda_graphs": False}, "cuda", 4)
    vocab = artifact.config.vocab_size
    step = decode_seconds(runner, 1, 5, 32, vocab)
    syncs = []
    sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (syncs.append(a), sync(*a))[1])
    rows = kernel_table(runner, 32, 3, vocab)
    assert len(syncs) == 3 + 1                                       # one per step (and the warm-up step)
    assert all(r.seconds > 0 for r in rows) and 0 < sum(r.seconds for r in rows) < step

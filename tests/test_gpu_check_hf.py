"""The device check cannot lose a number: the transformers baselines in child processes with a time
limit, the JSON rewritten atomically after every piece, and every package checked in the first
second (tools/gpu_check_hf.py, gpu_check_run.py, gpu_check_env.py), on a CPU with torch standing in."""

from __future__ import annotations

import json
import sys
import time
from argparse import Namespace

import pytest

from llmc.tools import gpu_check, gpu_check_env, gpu_check_hf, gpu_check_run
from llmc.tools.bench import BenchRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RUN = ["--device", "cpu", "--backend", "torch", "--batches", "1", "--decode-steps", "1", "--context", "8",
       "--greedy-tokens", "2", "--quant", "none", "--bench", "default", "--bench-requests", "2",
       "--bench-prompt-len", "8", "--bench-output-len", "2"]


def stand_in(monkeypatch, code: str) -> None:
    """The baseline's child becomes `python -c code` (given the spec and result paths as argv)."""
    monkeypatch.setattr(gpu_check_hf, "child_command",
                        lambda spec, result: [sys.executable, "-c", code, str(spec), str(result)])


def test_a_baseline_killed_by_its_time_limit_leaves_llmcs_numbers(tiny_family, tmp_path, monkeypatch, capsys):
    """The child copies the JSON as it stands while the baseline runs, then sleeps past --hf-timeout;
    the next part then dies outright (a kill, not an error the check catches): the file keeps all."""
    out, seen = tmp_path / "result.json", tmp_path / "seen-while-the-baseline-ran.json"
    stand_in(monkeypatch, f"import shutil, time; shutil.copy({str(out)!r}, {str(seen)!r}); time.sleep(120)")

    def killed_in_fp16(args, folder, anchor, dtype, kernels):
        if dtype == "float16":
            raise KeyboardInterrupt             # what a kill in the later part leaves: no handler runs
        return {"error": "this test skips the bf16 measurements"}

    monkeypatch.setattr(gpu_check_run, "check_dtype", killed_in_fp16)
    argv = ["--bundle", str(tiny_family("llama_gqa")[1]), *RUN, "--dtypes", "bfloat16,float16", "--hf", "static",
            "--hf-timeout", "3", "--work", str(tmp_path / "work"), "--json", str(out)]
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(argv)
    assert time.perf_counter() - start < 100                           # the sleeping child did not hold it
    during = json.loads(seen.read_text())["bench"]["default"]
    assert during["llmc"]["output_tokens"] == 4 and during["baselines"] == {}
    result = json.loads(out.read_text())
    bench = result["bench"]["default"]
    assert bench["llmc"] == during["llmc"]
    assert bench["baselines"]["hf_static"] == {"error": "timed out after 3 s (--hf-timeout); the child was killed"}
    assert "float32" in result["anchor"] and list(result["dtypes"]) == ["bfloat16"]   # the killed part: nothing
    assert not list(tmp_path.glob(".result.json.*"))                 # no temporary file left beside it


def baseline_args(tmp_path, timeout: float = 60.0) -> Namespace:
    return Namespace(device="cpu", hf_timeout=timeout, work=tmp_path)


def test_a_baseline_that_dies_or_fails_is_that_baselines_error(tmp_path, monkeypatch):
    requests = [BenchRequest([5, 6, 7], 2, 0.0)]
    stand_in(monkeypatch, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    died = gpu_check_hf.hf_baseline(tmp_path / "artifact", requests, "static", baseline_args(tmp_path), tmp_path)
    assert died["error"].startswith("the baseline's process ended with killed by signal 9")
    stand_in(monkeypatch, "import sys; sys.exit('ImportError: transformers is too old')")
    failed = gpu_check_hf.hf_baseline(tmp_path / "artifact", requests, "continuous", baseline_args(tmp_path), tmp_path)
    assert failed == {"error": "the baseline's process ended with exit code 1: ImportError: transformers is too old"}
    stand_in(monkeypatch, "import json, sys; spec = json.load(open(sys.argv[1])); json.dump("
                          "{'output_tokens': len(spec['requests']), 'mode': spec['mode']}, open(sys.argv[2], 'w'))")
    assert gpu_check_hf.hf_baseline(tmp_path / "artifact", requests, "static", baseline_args(tmp_path), tmp_path) == \
        {"output_tokens": 1, "mode": "static"}


def test_the_json_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "result.json"
    gpu_check_run.save_json(path, {"dtypes": {"bfloat16": {"ok": True}}})

    class Unprintable:
        def __str__(self):
            raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        gpu_check_run.save_json(path, {"dtypes": {"bfloat16": {"ok": True}}, "quant": {"int4": Unprintable()}})
    assert json.loads(path.read_text()) == {"dtypes": {"bfloat16": {"ok": True}}}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_a_missing_package_is_one_sentence_with_the_wheel_commands(monkeypatch, capsys, tmp_path):
    needed = gpu_check_env.needed_modules
    monkeypatch.setattr(gpu_check_env, "needed_modules", lambda args: needed(args) + ["wheelless_package"])
    assert gpu_check.main(["--bundle", str(tmp_path), "--device", "cpu", "--backend", "torch"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "Python package wheelless_package, which is not installed" in err
    assert "pip download --no-deps" in err and "wheelless_package -d wheels/" in err
    assert "pip install --no-deps --no-index wheels/*.whl" in err
    assert "Jinja2" in gpu_check_env.wheel_advice("jinja2.sandbox")
    assert "PYTHONPATH" in gpu_check_env.wheel_advice("gguf") and "prepare" in gpu_check_env.wheel_advice("gguf")


def test_the_packages_each_part_needs_are_named_up_front(monkeypatch):
    args = gpu_check.parse_args(["--bundle", "b", "--backend", "triton", "--hf", "static"])
    modules = gpu_check_env.needed_modules(args)
    assert {"triton", "transformers", "llmc.tools.bench", "llmc.tools.gpu_check_hf", "gguf"} <= set(modules)
    quiet = gpu_check.parse_args(["--bundle", "b", "--backend", "torch", "--hf", "none"])
    assert not {"triton", "transformers"} & set(gpu_check_env.needed_modules(quiet))
    monkeypatch.setattr(gpu_check_env, "_version", lambda name: "4.55.2" if name == "transformers" else "1.0")
    with pytest.raises(gpu_check_env.MissingPackage, match="needs transformers 4.56 or newer .* found 4.55.2"):
        gpu_check_env.require_packages(gpu_check.parse_args(["--bundle", "b", "--backend", "torch",
                                                             "--hf", "static,continuous"]))
    assert gpu_check_env.require_packages(quiet)["transformers"] == "4.55.2"     # static needs no manager


def test_a_part_that_fails_after_saving_keeps_what_it_saved(tiny_family, tmp_path, monkeypatch, capsys):
    llmc = {"output_tok_s": 5.0, "ttft_s": {"p50": 0.1, "p99": 0.2}, "tpot_s": {"p50": 0.01, "p99": 0.02}}

    def bench_then_fail(args, artifact, name, save):
        save({"llmc": llmc, "baselines": {}})
        raise RuntimeError("the harness broke after llmc's run")

    monkeypatch.setattr(gpu_check_run, "run_bench", bench_then_fail)
    monkeypatch.setattr(gpu_check_run, "dtype_artifact", lambda args, folder, dtype: tmp_path / "unused")
    monkeypatch.setattr(gpu_check_run, "plan", lambda args: [("bench", "default")])
    bundle = tiny_family("llama_gqa")[1]
    args = gpu_check.parse_args(["--bundle", str(bundle), *RUN, "--json", str(tmp_path / "r.json")])
    result = gpu_check_run.run_check(args, {"torch": "2", "triton": "3", "transformers": "5"})
    want = {"llmc": llmc, "baselines": {}, "interrupted": "RuntimeError: the harness broke after llmc's run"}
    assert result["bench"]["default"] == want == json.loads((tmp_path / "r.json").read_text())["bench"]["default"]
    assert "interrupted after llmc's run: RuntimeError" in capsys.readouterr().err      # the table so far

"""The cuda target through the command line: compile writes a kernel per unit, `llmc kernels` shows
them, `--backend triton` runs them (in the interpreter here), and every misuse is one sentence."""

from __future__ import annotations

import json
import shutil

import pytest

from llmc.compiler.codegen import kernel_units, lower
from llmc.compiler.codegen.templates import unit_launches
from llmc.compiler.driver import CompileConfig, compile_model
from llmc.runtime.artifact import load_artifact

from test_bad_inputs import assert_process_error, run_llmc


@pytest.fixture(scope="module")
def folder(tiny_family):
    return tiny_family("llama_hd32")[1]


@pytest.fixture(scope="module")
def cuda_artifact(folder, tmp_path_factory):
    return compile_model(folder, tmp_path_factory.mktemp("cuda") / "art", CompileConfig(target="cuda"))


@pytest.fixture(scope="module")
def cpu_artifact(tiny_family):
    return tiny_family("llama_hd32")[2]


def test_the_cuda_artifact_holds_one_hashed_module_per_distinct_kernel(cuda_artifact):
    art = load_artifact(cuda_artifact)
    assert art.manifest["backends"] == ["torch", "triton"] and art.manifest["compile"]["target"] == "cuda"
    lowering = lower(art.graphs)
    files = {p.stem for p in (cuda_artifact / "kernels").glob("*.py")}          # kernels/cpu/ holds the C++
    assert files == set(lowering.modules) and len(files) < sum(len(p) for p in lowering.plan.values())
    assert all(f"kernels/{name}.py" in art.manifest["files"] for name in files)
    report = json.loads((cuda_artifact / "report.json").read_text())
    assert report["kernels"]["modules"] == len(files)


def test_llmc_kernels_lists_units_and_prints_a_groups_source(cuda_artifact):
    listing = run_llmc("kernels", cuda_artifact)
    assert listing.returncode == 0, listing.stderr
    assert "linear+silu_mul" in listing.stdout and "distinct kernel modules" in listing.stdout
    # a decode layer: add_rmsnorm+qkv+rope_kv_write, attention's split stage, o_proj with the merge as its
    # prologue, add_rmsnorm+gate/up+silu_mul, down; 9 with the norms, the rope and the merge launched on their
    # own (kernel_units)
    graphs = load_artifact(cuda_artifact).graphs
    lowering = lower(graphs)
    assert f"the decode step launches {sum(lowering.launches('decode'))} kernels, 5 a layer" in listing.stdout
    assert "paged_decode_attention+linear " in listing.stdout
    unfused = kernel_units(graphs["decode"])
    at = [i for i, u in enumerate(unfused) if u.nodes[0].op == "paged_decode_attention"]
    assert sum(unit_launches(u) for u in unfused[at[0]:at[1]]) == 9
    assert "paged_decode_attention" in listing.stdout and "(2 launches)" in listing.stdout
    group = load_artifact(cuda_artifact).graphs["decode"]
    number = next(n.attrs["group"] for n in group.nodes if "group" in n.attrs)
    shown = run_llmc("kernels", cuda_artifact, "--group", number)
    assert shown.returncode == 0, shown.stderr
    assert f"group {number}" in shown.stdout and "= linear(" in shown.stdout and "def build(device):" in shown.stdout


def test_generate_with_the_triton_backend_says_what_the_torch_backend_says(cuda_artifact):
    args = ("generate", cuda_artifact, "hello", "--max-tokens", "6", "--no-chat")
    torch_out, triton_out = run_llmc(*args, "--backend", "torch"), run_llmc(*args, "--backend", "triton")
    assert torch_out.returncode == triton_out.returncode == 0, triton_out.stderr
    assert triton_out.stdout == torch_out.stdout and triton_out.stdout.strip()


def test_the_cuda_artifact_still_runs_on_the_torch_backend_by_default_here(cuda_artifact):
    proc = run_llmc("generate", cuda_artifact, "hi", "--max-tokens", "3", "--no-chat", env={"TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr


def test_an_unknown_target_is_one_sentence(folder, tmp_path):
    assert_process_error(run_llmc("compile", folder, "-o", tmp_path / "a", "--target", "tpu"), "'tpu'", "cpu, cuda")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_an_unknown_backend_is_one_sentence(cpu_artifact, command):
    args = ("generate", cpu_artifact, "hi") if command == "generate" else ("bench", cpu_artifact, "--num-requests", 1)
    assert_process_error(run_llmc(*args, "--backend", "warp"), "'warp'", "torch, triton")


def test_the_triton_backend_on_an_artifact_without_kernels_is_one_sentence(cpu_artifact):
    assert_process_error(run_llmc("generate", cpu_artifact, "hi", "--backend", "triton"),
                         "no Triton kernels", "--target cuda")


def test_the_triton_backend_without_a_gpu_or_the_interpreter_is_one_sentence(cuda_artifact):
    proc = run_llmc("generate", cuda_artifact, "hi", "--backend", "triton", env={"TRITON_INTERPRET": "0"})
    assert_process_error(proc, "needs a CUDA GPU", "TRITON_INTERPRET=1")


def test_a_kernel_edited_after_compile_is_refused_in_one_sentence(cuda_artifact, tmp_path):
    copy = shutil.copytree(cuda_artifact, tmp_path / "edited")
    kernel = next((copy / "kernels").glob("pointwise_*.py"))
    kernel.write_text(kernel.read_text().replace("tl.rsqrt", "tl.sqrt"))
    for command in (("generate", copy, "hi", "--backend", "triton"), ("kernels", copy), ("inspect", copy)):
        assert_process_error(run_llmc(*command), kernel.name, "recompile")


def test_a_unit_codegen_cannot_lower_fails_the_compile_and_writes_nothing(folder, tmp_path):
    proc = run_llmc("compile", folder, "-o", tmp_path / "a", "--target", "cuda", "--disable-pass", "fuse_rope_kv_write")
    assert_process_error(proc, "cannot lower", "fuse_rope_kv_write")
    assert not (tmp_path / "a").exists()


def test_llmc_kernels_on_a_missing_group_is_one_sentence(cuda_artifact):
    assert_process_error(run_llmc("kernels", cuda_artifact, "--group", 999), "no group 999")   # (a cpu artifact:
    # its C++ units, tests/test_cpu_units.py)

"""CPU units and their generated C++ in an artifact (compiler/codegen/cpu_units.py, cpu_lowering.py,
runtime/cpu_program.py, kernels/generated.py): a group cut into template nodes and generated runs,
producers first; the artifact's kernels/cpu/generated.cpp is what this llmc generates (an edited
or missing one is refused in one sentence), and `llmc kernels` shows it for a cpu-target
artifact; what codegen cannot write is named; a build is named by its content and left whole, also
when two processes build it at once, and a failed build is one sentence."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from llmc.compiler.artifact_format import CPU_KERNELS_FILE, MANIFEST, file_entry
from llmc.compiler.codegen import CodegenError
from llmc.compiler.codegen.cpu_lowering import lower_cpu
from llmc.compiler.codegen.cpu_units import cpu_units, is_generated
from llmc.compiler.ir import Value, parse_graph
from llmc.compiler.ops import verify
from llmc.kernels.generated import library_digest, load_generated
from llmc.kernels.native import NativeBuildError
from llmc.passes.fusion_grouping import fusion_grouping
from llmc.passes.rewrite import PassContext
from llmc.runtime.artifact import ArtifactError, load_artifact
from llmc.runtime.cpu_program import CpuKernels, CpuProgram, load_cpu_kernels
from llmc.runtime.executor import KVCacheSpec
from llmc.runtime.torch_executor import TorchExecutor, TorchOptions

from test_bad_inputs import assert_process_error, run_llmc


def graph(text: str, grouped: bool = True):
    g = parse_graph("graph g {\n" + textwrap.indent(textwrap.dedent(text).strip(), "  ") + "\n}\n")
    verify(g)
    return fusion_grouping(g, PassContext()) if grouped else g


GEMM_EPILOGUE = """
    %x = input() : f32[T,32]
    %r = input() : f32[T,48]
    %w.p = weight() : f32[96,32]
    %0 = linear(%x, %w.p, group=0) : f32[T,96]
    %1 = silu_mul(%0, group=0) : f32[T,48]
    %2 = add(%1, %r, group=0) : f32[T,48]
    %3 = mul(%2, %1, group=0) : f32[T,48]
    return %3
"""                                # one group, as a GEMM with an elementwise epilogue


def test_a_gemm_group_is_a_template_node_then_one_generated_run():
    g = graph(GEMM_EPILOGUE, grouped=False)
    units = cpu_units(g)
    assert [[n.op for n in u.nodes] for u in units] == [["linear"], ["silu_mul", "add", "mul"]]
    assert [is_generated(u) for u in units] == [False, True] and [u.index for u in units] == [0, 1]
    linear, run = units
    assert linear.outputs == (Value("0"),) and run.inputs == (Value("0"), Value("r"))
    assert run.outputs == (Value("3"),)           # %1 and %2 are read only inside the run
    plan = lower_cpu({"g": g}).plan["g"]
    assert plan[0] is None and plan[1].startswith("llmc_silu_mul_add_mul_")


def test_what_codegen_cannot_write_is_named():
    cases = {
        "f32[T,C]": ("%x = input() : f32[T,C]\n%0 = silu(%x) : f32[T,C]\nreturn %0", "symbolic|fixed C"),
        "i64": ("%x = input() : i64[T,8]\n%0 = cast(%x, dtype='f32') : f32[T,8]\nreturn %0", "computes in f32"),
        "1-D": ("%a = input() : f32[8]\n%0 = silu(%a) : f32[8]\nreturn %0", r"\[rows, C\]"),
    }
    for what, (text, words) in cases.items():
        with pytest.raises(CodegenError, match=rf"g unit 0 \(node %0\) \(.+\): .*({words})"):
            lower_cpu({"g": graph(text, grouped=False)})


def _kernels_for(g, library) -> CpuKernels:
    return CpuKernels({"g": g}, lower_cpu({"g": g}), library)


def test_a_build_is_named_by_its_source_and_leaves_no_partial_files(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))
    g = graph("%x = input() : f32[T,20]\n%0 = silu(%x) : f32[T,20]\nreturn %0", grouped=False)
    source = lower_cpu({"g": g}).source()
    library = load_generated(source)
    assert library.path.name == f"{library_digest(source)}.so" and library_digest(source + " ") != library.path.stem
    assert sorted(p.suffix for p in library.path.parent.iterdir()) == [".cpp", ".so"]   # the source kept beside it
    x = torch.randn(3, 20)
    (out,) = CpuProgram(g, {}, {}, _kernels_for(g, library))({"x": x})
    torch.testing.assert_close(out, torch.nn.functional.silu(x))


def test_processes_building_one_library_at_once_each_load_a_whole_one(tmp_path):
    """Two processes build the same source into one fresh cache at once: both load it and run it."""
    code = textwrap.dedent("""
        import ctypes, torch
        from llmc.compiler.codegen.cpu_lowering import lower_cpu
        from llmc.compiler.ir import parse_graph
        from llmc.kernels.generated import load_generated
        g = parse_graph("graph g {\\n  %x = input() : f32[T,20]\\n  %0 = silu(%x) : f32[T,20]\\n  return %0\\n}\\n")
        lowering = lower_cpu({"g": g})
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(
            load_generated(lowering.source()).address(lowering.plan["g"][0]))
        x, out = torch.randn(4, 20), torch.empty(4, 20)
        ptrs, strides = torch.tensor([x.data_ptr(), out.data_ptr()]), torch.tensor([20, 20])
        fn(ptrs.data_ptr(), strides.data_ptr(), 0, 4)
        torch.testing.assert_close(out, torch.nn.functional.silu(x))
        """)
    env = dict(os.environ, LLMC_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    built = list(tmp_path.rglob("generated/*"))
    assert sorted(p.suffix for p in built) == [".cpp", ".so"]          # one library, no partial file left


def test_a_failed_build_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(NativeBuildError, match=r"no-such-c\+\+.* could not build the generated CPU kernels .*"
                                               r"--kernels reference"):
        load_generated(lower_cpu({"g": graph("%x = input() : f32[T,8]\n%0 = silu(%x) : f32[T,8]\nreturn %0",
                                             grouped=False)}).source())
    assert not list(tmp_path.rglob("generated/*"))


@pytest.fixture(scope="module")
def cpu_artifact(tiny_family):
    return tiny_family("llama_hd32")[2]


def test_every_artifact_holds_its_generated_cpp_and_the_native_executor_runs_it(cpu_artifact):
    art = load_artifact(cpu_artifact)
    assert art.manifest["compile"]["target"] == "cpu" and CPU_KERNELS_FILE in art.manifest["files"]
    kernels = load_cpu_kernels(art)
    assert (cpu_artifact / CPU_KERNELS_FILE).read_text() == kernels.lowering.source()
    report = json.loads((cpu_artifact / "report.json").read_text())["cpu_kernels"]
    assert report["functions"] == len(kernels.lowering.functions) < report["generated_units"]["decode"]


def _rehashed(copy, path) -> None:
    manifest = json.loads((copy / MANIFEST).read_text())
    if path.exists():
        manifest["files"][CPU_KERNELS_FILE] = file_entry(path)
    else:
        del manifest["files"][CPU_KERNELS_FILE]
    (copy / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit", ["edited", "missing"])
def test_generated_cpp_other_than_this_llmcs_is_refused_in_one_sentence(cpu_artifact, tmp_path, edit):
    copy = shutil.copytree(cpu_artifact, tmp_path / "copy")
    path = copy / CPU_KERNELS_FILE
    if edit == "edited":
        path.write_text(path.read_text().replace("rsqrt16(", "sqrt16("))
    else:
        path.unlink()
    _rehashed(copy, path)                                   # the manifest agrees: another codegen wrote it
    art = load_artifact(copy)
    kv = KVCacheSpec.from_graph_type(art.graphs["decode"].node_map()["kv_cache"].type, 8, 16)
    words = "differs from what this llmc generates" if edit == "edited" else "lacks kernels/cpu/generated.cpp"
    with pytest.raises(ArtifactError, match=f"{words}.*recompile it"):
        TorchExecutor(art, torch.device("cpu"), kv, TorchOptions(kernels="native"))
    TorchExecutor(art, torch.device("cpu"), kv, TorchOptions(kernels="reference"))      # the refs need no C++
    assert_process_error(run_llmc("kernels", copy), CPU_KERNELS_FILE, "recompile")


def test_llmc_kernels_shows_a_cpu_artifacts_units_and_a_groups_cpp(cpu_artifact):
    listing = run_llmc("kernels", cpu_artifact)
    assert listing.returncode == 0, listing.stderr
    assert "template" in listing.stdout and "llmc_add_rmsnorm_" in listing.stdout
    assert "distinct generated C++ functions" in listing.stdout and "kernel modules" not in listing.stdout
    group = next(n.attrs["group"] for n in load_artifact(cpu_artifact).graphs["decode"].nodes if "group" in n.attrs)
    shown = run_llmc("kernels", cpu_artifact, "--group", group)
    assert shown.returncode == 0, shown.stderr
    assert "linear -> a hand-written template" in shown.stdout
    assert 'extern "C" void llmc_silu_mul_' in shown.stdout and "= silu_mul(" in shown.stdout

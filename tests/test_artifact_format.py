"""The artifact format is one closed contract that the writer and the loader share: the manifest
lists exactly the files written, `llmc compile -o` onto an artifact replaces it whole (an
interrupted write leaves the old one), and a folder that is not purely an llmc artifact is
never replaced. (Spoilt artifacts, one sentence each: tests/test_bad_inputs.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmc.compiler import artifact as writer
from llmc.compiler.artifact_format import file_entries
from llmc.compiler.driver import CompileConfig, compile_model
from llmc.runtime.artifact import load_artifact
from llmc.tools.cli import app
from test_bad_inputs import assert_cli_error, snapshot

FAMILY = "llama_gqa"


@pytest.fixture(scope="module")
def source(tiny_family) -> Path:
    return tiny_family(FAMILY)[1]


def manifest(artifact: Path) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


def test_the_manifest_lists_exactly_the_files_written(tiny_family):
    artifact = tiny_family(FAMILY)[2]
    assert manifest(artifact)["files"] == file_entries(artifact)
    written = (p.relative_to(artifact).as_posix() for p in artifact.rglob("*") if p.is_file())
    assert sorted(manifest(artifact)["files"]) == sorted(name for name in written if name != "manifest.json")


def test_the_writer_does_not_import_the_runtime():
    code = "import sys, llmc.compiler.artifact, llmc.compiler.driver; print(sorted(m for m in sys.modules if m.startswith('llmc.runtime')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_compile_onto_an_artifact_replaces_it_whole(source, tmp_path):
    out = tmp_path / "art"
    assert CliRunner().invoke(app, ["compile", str(source), "-o", str(out)]).exit_code == 0
    result = CliRunner().invoke(app, ["compile", str(source), "-o", str(out), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert manifest(out)["compile"]["dtype"] == "bfloat16"
    assert {w.dtype for w in load_artifact(out).weights.values()} == {torch.bfloat16}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no staging or old copy left


def test_an_interrupted_write_leaves_the_old_artifact(source, tmp_path, monkeypatch):
    out = compile_model(source, tmp_path / "art")
    before = snapshot(out)

    def fail(staging, *args):
        (staging / "prefill.ir").write_text("half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_write_files", fail)
    with pytest.raises(KeyboardInterrupt):
        compile_model(source, out, CompileConfig(dtype="bfloat16"))
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize("spoil, words", [
    (lambda a: (a / "my_notes.md").write_text("keep\n"), ("my_notes.md", "not listed", "not replaced")),
    (lambda a: (a / "manifest.json").write_text('{"name": "my web app"}'), ("not an llmc artifact",)),
])
def test_compile_never_replaces_a_folder_that_is_not_purely_an_artifact(source, tmp_path, spoil, words):
    out = compile_model(source, tmp_path / "art")
    spoil(out)
    before = snapshot(out)
    assert_cli_error(CliRunner().invoke(app, ["compile", str(source), "-o", str(out)]), *words, "choose another -o")
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_an_artifact_records_the_code_that_compiled_it(tiny_family, monkeypatch):
    manifest = load_artifact(tiny_family(FAMILY)[2]).manifest
    assert manifest["versions"]["compiler_code"] == writer.compiler_code_hash()
    assert writer.stale_code(manifest) is None
    monkeypatch.setattr(writer, "compiler_code_hash", lambda: "0123456789abcdef")     # a checkout changed since
    assert "compiled by other llmc code" in writer.stale_code(manifest) and "compile it again" in writer.stale_code(manifest)


def test_the_cached_default_artifact_is_compiled_again_when_the_code_changed(tiny_family, tmp_path, monkeypatch):
    """tools/default_artifact.py reuses its cached compile only while the compiler's code is the same."""
    from llmc.tools import default_artifact as cached

    compiles = []
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cached, "compile_model", lambda model, out: compiles.append(out) or compile_model(
        tiny_family(FAMILY)[1], out))
    first = cached.default_artifact()
    assert len(compiles) == 1 and cached.default_artifact().path == first.path and len(compiles) == 1   # reused
    monkeypatch.setattr(writer, "compiler_code_hash", lambda: "0123456789abcdef")
    cached.default_artifact()
    assert len(compiles) == 2                                                                    # compiled again

"""Every bad input gets one clear sentence: from the API as a typed error, and from the CLI as
that sentence on stderr, exit code 1 and no traceback.

CLI cases run in-process through typer's CliRunner (a real `llmc` process costs ~2 s of
imports); an uncaught exception shows there as `result.exception`, so "exit 1 and the
exception is the SystemExit of `user_errors`" is the no-traceback check. A few cases, and the
good path, also run as real `llmc` processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner, Result

from llmc.models.config import ModelError
from llmc.models.loader import load_model
from llmc.passes.pipeline import pass_names
from llmc.runtime.artifact import ArtifactError, load_artifact
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import RequestError, SamplingParams
from llmc.tools.cli import app

FAMILY = "llama_gqa"
MISSING_WEIGHT = "model.layers.1.mlp.up_proj.weight"  # llmc's name: layers.1.up_proj.weight


# ----------------------------------------------------------------------------- helpers


def one_line(text: str) -> str:
    """stderr with rich's line wrapping undone."""
    return " ".join(text.split())


def error_line(stderr: str) -> str:
    """stderr less llmc's own notes before the error (log lines such as a graph run op by op, each
    'llmc: ...'), rich's line wrapping undone."""
    return one_line("\n".join(line for line in stderr.splitlines() if not line.startswith("llmc: ")))


def assert_one_sentence(message: str, *words: str) -> None:
    assert "\n" not in message and ". " not in message.rstrip("."), message
    for w in words:
        assert w in message, f"{w!r} not in {message!r}"


def cli(*args) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_cli_error(result, *words: str) -> None:
    """Exit 1 through `user_errors` (not an uncaught exception), the words on stderr."""
    assert isinstance(result.exception, SystemExit), f"uncaught {result.exception!r}\n{result.output}"
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert result.stdout == ""
    message = error_line(result.stderr)
    assert message.startswith("error: ")
    assert_one_sentence(message.removeprefix("error: "), *words)


def run_llmc(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A real `llmc` process (bytes out, so no newline translation of generated text)."""
    proc = subprocess.run([sys.executable, "-m", "llmc.tools.cli", *map(str, args)], capture_output=True,
                          timeout=120, env=None if env is None else {**os.environ, **env})
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def assert_process_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert_one_sentence(error_line(proc.stderr).removeprefix("error: "), *words)


@pytest.fixture(scope="module")
def good(tiny_family):
    """(HF folder, compiled artifact) of a tiny model; never modified."""
    _, folder, artifact = tiny_family(FAMILY)
    return folder, artifact


# ----------------------------------------------------------------------------- HF folders


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _drop_weight(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[MISSING_WEIGHT]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


HF_EDITS = {
    "unsupported_architecture": lambda p: _edit_json(p / "config.json", architectures=["GPT2LMHeadModel"]),
    "no_config": lambda p: (p / "config.json").unlink(),
    "no_safetensors": lambda p: [f.unlink() for f in p.glob("*.safetensors")],
    "no_tokenizer": lambda p: (p / "tokenizer.json").unlink(),
    "missing_weight": _drop_weight,
}
HF_WORDS = {
    "unsupported_architecture": ("'GPT2LMHeadModel'", "not supported", "LlamaForCausalLM"),
    "no_config": ("no config.json", "Hugging Face model folder"),
    "no_safetensors": ("no *.safetensors file",),
    "no_tokenizer": ("no tokenizer.json",),
    "missing_weight": ("'layers.1.up_proj.weight'", "incomplete"),
    "does_not_exist": ("does not exist", "Hugging Face folder or a .gguf file"),
    "not_a_model_file": ("neither a model folder nor a .gguf file",),
}


def edited_copies(folder: Path, root: Path, edits: dict) -> dict[str, Path]:
    """One copy of `folder` per edit, under `root`, each spoilt by its edit."""
    copies = {}
    for name, edit in edits.items():
        copies[name] = Path(shutil.copytree(folder, root / name))
        edit(copies[name])
    return copies


@pytest.fixture(scope="module")
def bad_sources(good, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_hf")
    sources = edited_copies(good[0], root, HF_EDITS)
    sources["does_not_exist"] = root / "no-such-model"
    sources["not_a_model_file"] = root / "notes.txt"
    sources["not_a_model_file"].write_text("not a model\n")
    return sources


@pytest.mark.parametrize("case", list(HF_WORDS))
def test_bad_model_source_is_one_model_error(bad_sources, case):
    with pytest.raises(ModelError) as info:
        load_model(bad_sources[case])
    assert_one_sentence(str(info.value), *HF_WORDS[case])


@pytest.mark.parametrize("case", list(HF_WORDS))
def test_compile_of_bad_model_source_exits_1(bad_sources, tmp_path, case):
    assert_cli_error(cli("compile", bad_sources[case], "-o", tmp_path / "out"), *HF_WORDS[case])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["[b]x[/b]y", "x[/b]"])
def test_rich_markup_in_a_message_is_printed_as_text(tmp_path, name):
    """Brackets in a path are text, not rich markup (eaten, or a MarkupError traceback)."""
    result = cli("compile", tmp_path / name, "-o", tmp_path / "out")
    assert_cli_error(result, name, "does not exist")


# ----------------------------------------------------------------------------- artifacts


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_ir(path: Path) -> None:
    text = path.read_text()
    assert "eps=1e-05" in text
    path.write_text(text.replace("eps=1e-05", "eps=2e-05", 1))  # same size, new sha256


def _edit_files(artifact: Path, edit) -> None:
    """Apply `edit` to the manifest's `files` section."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    edit(manifest["files"])
    (artifact / "manifest.json").write_text(json.dumps(manifest))


def _unlisted_edited_ir(artifact: Path) -> None:
    _edit_files(artifact, lambda files: files.pop("prefill.ir"))
    _edit_ir(artifact / "prefill.ir")


def _no_file_list(artifact: Path) -> None:
    _edit_json(artifact / "manifest.json", files=None)
    _truncate(artifact / "weights.safetensors")


ARTIFACT_EDITS = {
    "truncated_weights": lambda a: _truncate(a / "weights.safetensors"),
    "edited_ir": lambda a: _edit_ir(a / "prefill.ir"),
    "newer_format": lambda a: _edit_json(a / "manifest.json", format_version=99),
    "no_manifest": lambda a: (a / "manifest.json").unlink(),
    "unlisted_edited_ir": _unlisted_edited_ir,
    "no_file_list": _no_file_list,
    "extra_file": lambda a: (a / "notes.txt").write_text("mine\n"),
    "extra_file_in_a_folder": lambda a: ((a / "kernels").mkdir(exist_ok=True),     # every artifact has kernels/cpu/
                                         (a / "kernels" / "k.py").write_text("x = 1\n")),
    "missing_file": lambda a: (a / "report.json").unlink(),
    "malformed_entry": lambda a: _edit_files(a, lambda files: files["decode.ir"].update(bytes="12")),
    "entry_outside": lambda a: _edit_files(a, lambda files: files.update({"../x": files["report.json"]})),
}
ARTIFACT_WORDS = {
    "truncated_weights": ("weights.safetensors", "truncated", "recompile"),
    "edited_ir": ("prefill.ir", "does not match its sha256", "edited", "recompile"),
    "newer_format": ("version 99", "newer", "upgrade llmc"),
    "no_manifest": ("no manifest.json", "not an llmc artifact", "llmc compile"),
    "unlisted_edited_ir": ("does not list prefill.ir", "recompile"),
    "no_file_list": ("no valid 'files' section", "recompile"),
    "extra_file": ("notes.txt", "is not listed in manifest.json", "remove the file or recompile"),
    "extra_file_in_a_folder": ("kernels/k.py", "is not listed in manifest.json"),
    "missing_file": ("report.json is missing", "recompile"),
    "malformed_entry": ("malformed entry for decode.ir", '"bytes": "12"', "recompile"),
    "entry_outside": ("lists '../x'", "not a path inside the artifact"),
    "does_not_exist": ("does not exist", "llmc compile -o"),
}


@pytest.fixture(scope="module")
def bad_artifacts(good, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_artifacts")
    artifacts = edited_copies(good[1], root, ARTIFACT_EDITS)
    artifacts["does_not_exist"] = root / "no-such-artifact"
    return artifacts


@pytest.mark.parametrize("case", list(ARTIFACT_WORDS))
def test_bad_artifact_is_one_artifact_error(bad_artifacts, case):
    with pytest.raises(ArtifactError) as info:
        load_artifact(bad_artifacts[case])
    assert_one_sentence(str(info.value), *ARTIFACT_WORDS[case])


@pytest.mark.parametrize("command", [["inspect"], ["generate", "--no-chat"]])
@pytest.mark.parametrize("case", list(ARTIFACT_WORDS))
def test_cli_on_bad_artifact_exits_1(bad_artifacts, case, command):
    args = [command[0], bad_artifacts[case], *(["hi", *command[1:]] if command[0] == "generate" else [])]
    assert_cli_error(cli(*args), *ARTIFACT_WORDS[case])


def test_inspect_of_good_artifact_says_verified(good):
    result = cli("inspect", good[1])
    assert result.exit_code == 0, result.output
    assert "verified" in result.stdout
    assert "graph      prefill" in result.stdout and "weights.safetensors" in result.stdout


# ----------------------------------------------------------------------------- requests

REQUEST_CASES = {  # prompt, options, words
    "zero_max_tokens": ("hi", ["--max-tokens", "0"], ("max_tokens=0", "at least 1")),
    "negative_temperature": ("hi", ["--temperature", "-1"], ("temperature=-1.0", "must be in [0, 100]")),
    "over_the_context": ("hi", ["--max-tokens", "1000"], ("max_tokens (1000)", "context of 256", "shorten")),
    "empty_prompt": ("", ["--no-chat"], ("prompt is empty",)),
    "unknown_kernels": ("hi", ["--kernels", "fast"], ("kernels 'fast' is unknown", "auto, native, reference")),
}


@pytest.mark.parametrize("case", list(REQUEST_CASES))
def test_generate_with_bad_request_exits_1(good, case):
    prompt, options, words = REQUEST_CASES[case]
    assert_cli_error(cli("generate", good[1], prompt, *options), *words)


@pytest.fixture(scope="module")
def engine(good) -> Engine:
    return Engine(good[1], EngineConfig(kv_cache_bytes=2**20))


@pytest.mark.parametrize("prompt, words", [
    ([], ("prompt is empty",)),
    ([5, 300], ("token id 300", "outside the vocabulary", "0..299")),
    ([-1], ("token id -1", "outside the vocabulary")),
])
def test_add_request_rejects_bad_prompt(engine, prompt, words):
    with pytest.raises(RequestError) as info:
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    assert_one_sentence(str(info.value), *words)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


# ----------------------------------------------------------------------------- compile options

OPTION_CASES = {
    "float8": (["--dtype", "float8"], ("dtype 'float8'", "float32, bfloat16, float16")),
    "unknown_pass": (["--disable-pass", "nonexistent"], ("no pass named 'nonexistent'", ", ".join(pass_names()))),
    "required_pass": (["--disable-pass", "insert_paged_attention"],
                      ("'insert_paged_attention' cannot be disabled",)),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_compile_with_bad_option_exits_1(good, tmp_path, case):
    options, words = OPTION_CASES[case]
    assert_cli_error(cli("compile", good[0], "-o", tmp_path / "out", *options), *words)
    assert not (tmp_path / "out").exists()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_compile_refuses_a_non_empty_directory_that_is_not_an_artifact(good, tmp_path):
    out = tmp_path / "my_work"
    (out / "sub").mkdir(parents=True)
    (out / "notes.md").write_text("nothing already accepted is lost\n")
    (out / "sub" / "data.bin").write_bytes(bytes(range(256)))
    before = snapshot(out)
    assert_cli_error(cli("compile", good[0], "-o", out), "is not an llmc artifact", "choose another -o")
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_work"]  # no .partial left behind


def test_compile_refuses_a_file_as_output(good, tmp_path):
    out = tmp_path / "model.txt"
    out.write_text("keep me\n")
    assert_cli_error(cli("compile", good[0], "-o", out), "is not a directory", "choose another -o")
    assert out.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.txt"]


# ----------------------------------------------------------------------------- real processes

PROCESS_CASES = {
    "unsupported_architecture": lambda s, a, t: (["compile", s["unsupported_architecture"], "-o", t / "o"],
                                                 HF_WORDS["unsupported_architecture"]),
    "truncated_weights_inspect": lambda s, a, t: (["inspect", a["truncated_weights"]],
                                                  ARTIFACT_WORDS["truncated_weights"]),
    "edited_ir_generate": lambda s, a, t: (["generate", a["edited_ir"], "hi"], ARTIFACT_WORDS["edited_ir"]),
    "zero_max_tokens": lambda s, a, t: (["generate", a["good"], "hi", "--max-tokens", "0"],
                                        REQUEST_CASES["zero_max_tokens"][2]),
}


@pytest.mark.parametrize("case", list(PROCESS_CASES))
def test_llmc_process_prints_one_sentence_and_exits_1(bad_sources, bad_artifacts, good, tmp_path, case):
    args, words = PROCESS_CASES[case](bad_sources, {**bad_artifacts, "good": good[1]}, tmp_path)
    assert_process_error(run_llmc(*args), *words)


def test_llmc_compile_inspect_generate_good_model(good, tmp_path):
    art = tmp_path / "art"
    compiled = run_llmc("compile", good[0], "-o", art)
    assert compiled.returncode == 0, compiled.stderr
    assert (art / "manifest.json").is_file() and not (tmp_path / "art.partial").exists()
    inspected = run_llmc("inspect", art)
    assert inspected.returncode == 0 and "verified" in inspected.stdout
    generated = run_llmc("generate", art, "hello", "--max-tokens", "5", "--no-chat")
    assert generated.returncode == 0, generated.stderr
    engine = Engine(art, EngineConfig(kv_cache_bytes=2**20))
    ids = engine.generate([engine.tokenizer.encode("hello")], SamplingParams(max_tokens=5, temperature=0.0))[0].token_ids
    assert generated.stdout == engine.tokenizer.decode(ids) + "\n"  # the answer and nothing else
    assert "TTFT" in generated.stderr and "TPOT" in generated.stderr
    assert "TTFT" not in generated.stdout


def test_no_cpp_compiler_fails_native_in_one_sentence_and_auto_falls_back(good, tmp_path):
    """No C++ compiler: --kernels native is an error; the default runs the torch refs, warned."""
    env = {"CXX": str(tmp_path / "no-such-c++"), "LLMC_CACHE_DIR": str(tmp_path / "cache")}
    native = run_llmc("generate", good[1], "hello", "--max-tokens", "3", "--kernels", "native", env=env)
    assert native.returncode == 1 and "Traceback" not in native.stderr and native.stdout == ""
    last = native.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    assert_one_sentence(last.removeprefix("error: "), "no-such-c++", "could not build", "--kernels reference")
    auto = run_llmc("generate", good[1], "hello", "--max-tokens", "3", "--no-chat", env=env)
    assert auto.returncode == 0, auto.stderr
    assert "running the torch reference kernels instead" in auto.stderr and auto.stdout.strip()

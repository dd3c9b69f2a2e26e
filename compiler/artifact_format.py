"""The artifact format: its files, its version, how they are hashed and how they are verified.

    manifest.json          format + version, model config, source hashes, pass list and options,
                           llmc / torch / triton versions, backends, and `files`: the size and
                           sha256 of every other file in the folder, by its path relative to it
    prefill.ir, decode.ir  the entry graphs in IR text
    draft.ir               (compiled with --draft-skip N only) the self-speculative draft: prefill's
                           inputs and output, N layers skipped, the same weights; listed in the
                           manifest's `entries` when present
    weights.safetensors    every weight the graphs reference, by canonical name
    tokenizer.json         Hugging Face fast-tokenizer file
    tokenizer_config.json  chat template, bos/eos tokens, add_bos_token
    report.json            what each pass did (hits, node counts, seconds), op counts per graph and
                           per decoder layer, seconds per compile stage
    kernels/<name>.py      (cuda target only) the generated Triton kernel modules, one per distinct
                           kernel, each listing the IR lines of the units it serves
    kernels/cpu/generated.cpp  the generated C++ of every elementwise and row-wise CPU unit
                           (compiler/codegen/cpu_lowering.py), one function per distinct kernel

The folder is closed: the manifest lists exactly the files present (sub-folders walked, paths
with `/`), each entry being `{"bytes": int, "sha256": 64 hex digits}`. `verify_files` refuses a
malformed entry, a listed file that is missing, a file that is present but unlisted (or a link,
or anything else than a plain file or folder), a wrong size and a wrong hash, each as one
`ArtifactError` sentence naming the file and the fix. The writer (compiler/artifact.py) and the
runtime's loader (runtime/artifact.py) both use this module; nothing here imports the runtime.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from llmc.models.provenance import file_sha256

FORMAT = "llmc-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ENTRY_FILES = {"prefill": "prefill.ir", "decode": "decode.ir"}       # every artifact has these
OPTIONAL_ENTRY_FILES = {"draft": "draft.ir"}                           # those compiled with one
ALL_ENTRY_FILES = ENTRY_FILES | OPTIONAL_ENTRY_FILES
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
REPORT_FILE = "report.json"
KERNELS_DIR = "kernels"            # cuda target: the generated Triton kernel modules, kernels/<name>.py
CPU_KERNELS_FILE = "kernels/cpu/generated.cpp"     # every target: the generated C++ CPU kernels
REQUIRED_FILES = (*ENTRY_FILES.values(), WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, REPORT_FILE)
MANIFEST_SECTIONS = {"model": dict, "source": dict, "compile": dict, "versions": dict, "backends": list,
                     "files": dict}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
FIX = "recompile the artifact"


class ArtifactError(Exception):
    """An artifact that cannot be used as it is; the message names the file and the fix."""


def present_files(root: Path) -> dict[str, Path]:
    """Every entry under `root` but the manifest, by its `/`-separated relative path; folders are
    walked, and anything that is not a plain file (a link, a socket) is returned as it is."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue
        name = path.relative_to(root).as_posix()
        if name != MANIFEST:
            found[name] = path
    return found


def file_entry(path: Path) -> dict[str, Any]:
    """The manifest's record of one file."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def file_entries(root: Path) -> dict[str, dict[str, Any]]:
    """The manifest's `files` section for everything in `root` (the writer's side)."""
    return {name: file_entry(path) for name, path in present_files(root).items()}


def is_artifact_manifest(manifest: Any) -> bool:
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, after checking that it is one, that this llmc reads its version and that
    every section has the right kind of value."""
    if not path.exists():
        raise ArtifactError(f"{path} does not exist; give the folder that `llmc compile -o` wrote")
    if not path.is_dir():
        raise ArtifactError(f"{path} is not a directory; give the folder that `llmc compile -o` wrote")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path} has no {MANIFEST}; it is not an llmc artifact (run `llmc compile`)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path / MANIFEST} is not valid JSON ({exc}); {FIX}") from None
    if not is_artifact_manifest(manifest):
        raise ArtifactError(f"{path / MANIFEST} is not an llmc artifact manifest; {FIX}")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {version} is newer than this llmc reads "
                            f"(version {FORMAT_VERSION}); upgrade llmc or recompile with this one")
    for key, kind in MANIFEST_SECTIONS.items():
        if not isinstance(manifest.get(key), kind):
            raise ArtifactError(f"{MANIFEST} has no valid {key!r} section (a JSON {kind.__name__} is expected); {FIX}")
    return manifest


def artifact_entries(manifest: dict[str, Any]) -> dict[str, str]:
    """The entry graphs an artifact holds, by name: prefill and decode, and each optional one its
    manifest lists (`entries`)."""
    listed = manifest.get("entries") if isinstance(manifest.get("entries"), dict) else {}
    return ENTRY_FILES | {e: f for e, f in OPTIONAL_ENTRY_FILES.items() if listed.get(e) == f}


def require_entry(path: Path, manifest: dict[str, Any], entry: str) -> str:
    """The file of entry graph `entry`, or an ArtifactError saying how to get one."""
    entries = artifact_entries(manifest)
    if entry in entries:
        return entries[entry]
    if entry == "draft":
        raise ArtifactError(f"{path} was compiled without a draft graph; compile it again with "
                            f"--draft-skip N to have one")
    raise ArtifactError(f"entry graph {entry!r} is unknown; an artifact has {', '.join(entries)}")


def _check_entry(name: Any, entry: Any) -> None:
    """One `files` entry: a safe relative path to a size and a sha256."""
    if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/") or name == MANIFEST:
        raise ArtifactError(f"{MANIFEST} lists {name!r}, which is not a path inside the artifact; {FIX}")
    if (not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"} or type(entry["bytes"]) is not int
            or entry["bytes"] < 0 or not isinstance(entry["sha256"], str) or not _SHA256.match(entry["sha256"])):
        raise ArtifactError(f"{MANIFEST} has a malformed entry for {name} ({json.dumps(entry)}; an entry is "
                            f'{{"bytes": size, "sha256": 64 hex digits}}); {FIX}')


def check_file_list(path: Path, listed: dict[str, Any]) -> dict[str, Path]:
    """The listed files, after checking that they are exactly the plain files present."""
    for name, entry in listed.items():
        _check_entry(name, entry)
    for name in REQUIRED_FILES:
        if name not in listed:
            raise ArtifactError(f"{MANIFEST} does not list {name}, which every artifact has; {FIX}")
    present = present_files(path)
    for name, file in present.items():
        if name not in listed:
            raise ArtifactError(f"{name} in {path} is not listed in {MANIFEST}: the artifact was edited "
                                f"after compiling; remove the file or {FIX}")
        if file.is_symlink() or not file.is_file():
            raise ArtifactError(f"{name} in {path} is not a plain file (an artifact holds only plain files); {FIX}")
    for name in listed:
        if name not in present:
            raise ArtifactError(f"artifact file {name} is missing from {path}; {FIX}")
    return present


def verify_files(path: Path, manifest: dict[str, Any]) -> None:
    """Check that the manifest lists exactly the files present, with their sizes and sha256."""
    listed = manifest["files"]
    present = check_file_list(path, listed)
    for name, entry in listed.items():
        size = present[name].stat().st_size
        if size != entry["bytes"]:
            raise ArtifactError(f"{name} is {size} bytes but the manifest records {entry['bytes']}: "
                                f"the file is truncated or replaced; {FIX}")
        if file_sha256(present[name]) != entry["sha256"]:
            raise ArtifactError(f"{name} does not match its sha256 in the manifest: the file was edited "
                                f"or corrupted; {FIX}")

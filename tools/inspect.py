"""`llmc inspect`: verify an artifact and summarise what is in it."""

from __future__ import annotations

from pathlib import Path

from llmc.compiler.ir import parse_graph
from llmc.runtime.artifact import ENTRY_FILES, verify_artifact


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def artifact_summary(path: str | Path) -> str:
    """Verify every file hash, then describe model, compile options, graphs and files."""
    path = Path(path)
    manifest = verify_artifact(path)
    model, compile_info, versions = manifest["model"], manifest["compile"], manifest["versions"]
    lines = [
        f"artifact   {path}  (format {manifest['format']} v{manifest['format_version']}, verified)",
        f"model      {model['architecture']}: {model['num_layers']} layers, hidden {model['hidden_size']}, "
        f"heads {model['num_heads']}/{model['num_kv_heads']} (q/kv), head_dim {model['head_dim']}, "
        f"vocab {model['vocab_size']}, context {model['max_position_embeddings']}",
        f"source     {manifest['source']['format']}: " +
        ", ".join(f"{name} ({sha[:12]})" for name, sha in manifest["source"]["files"].items()),
        f"compile    dtype {compile_info['dtype']}; passes {' -> '.join(compile_info['passes'])}"
        + (f"; disabled {', '.join(compile_info['disabled_passes'])}" if compile_info["disabled_passes"] else ""),
        f"versions   llmc {versions['llmc']}, torch {versions['torch']}, triton {versions['triton']}; "
        f"backends {', '.join(manifest['backends'])}",
    ]
    for entry, file in ENTRY_FILES.items():
        graph = parse_graph((path / file).read_text())
        ops = graph.op_counts()
        body = sum(v for k, v in ops.items() if k not in ("input", "weight"))
        lines.append(f"graph      {entry}: {body} ops, {ops.get('weight', 0)} weights, inputs "
                     + ", ".join(f"{n.name}:{n.type}" for n in graph.inputs()))
    for name, entry in manifest["files"].items():
        lines.append(f"file       {name:<24} {_human_bytes(entry['bytes']):>10}  sha256 {entry['sha256'][:16]}")
    return "\n".join(lines)

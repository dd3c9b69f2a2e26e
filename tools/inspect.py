"""`llmc inspect`: verify an artifact and summarise what is in it."""

from __future__ import annotations

from pathlib import Path

from llmc.runtime.artifact import verify_artifact


def human_bytes(n: float, digits: int = 1) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB; TiB is the largest unit."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n, power = n / 1024, power + 1
    return f"{n:,.0f} B" if power == 0 else f"{n:,.{digits}f} {units[power]}"


def artifact_summary(path: str | Path) -> str:
    """Verify every file hash, then describe model, compile options, graphs and files."""
    path = Path(path)
    manifest, graphs = verify_artifact(path)
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
    for entry, graph in graphs.items():
        ops = graph.op_counts()
        body = sum(v for k, v in ops.items() if k not in ("input", "weight"))
        lines.append(f"graph      {entry}: {body} ops, {ops.get('weight', 0)} weights, inputs "
                     + ", ".join(f"{n.name}:{n.type}" for n in graph.inputs()))
    for name, entry in manifest["files"].items():
        lines.append(f"file       {name:<24} {human_bytes(entry['bytes']):>10}  sha256 {entry['sha256'][:16]}")
    return "\n".join(lines)

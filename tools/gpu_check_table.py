"""The GPU check's verdicts and its closing table, computed from the result dict alone (so CI
checks them on a CPU run with the torch backend standing in for triton).

Result layout (what tools/gpu_check.py fills; also written as JSON):
  env            {device, gpu, torch, triton, transformers, date, backend, copy_bandwidth}
  dtypes         {dtype: {logits: compare_logits(..) + tolerance, greedy: [first_divergence rows],
                          decode: {batch: {"eager": s, "graphs": s | None}},
                          floor: {bytes, seconds}, kernels: [KernelRow dicts] (first dtype only)}}
  bench          {workload name: {llmc: run_llmc(..), baselines: hf_baselines(..)}}
"""

from __future__ import annotations

import torch

from llmc.compiler.dtypes import USER_DTYPES, to_torch

RELATIVE_TOLERANCE = 4           # max |logit difference| allowed, in units of eps(dtype) x max |logit|
DTYPES = {user: to_torch(ir) for user, ir in USER_DTYPES.items()}          # float32, bfloat16, float16
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def measured(parts: dict) -> dict:
    """The parts (dtypes or workloads) that ran, without those that failed."""
    return {name: part for name, part in parts.items() if "error" not in part}


def logits_tolerance(dtype: str, scale: float) -> float:
    return RELATIVE_TOLERANCE * torch.finfo(DTYPES[dtype]).eps * scale


def greedy_verdict(rows: list[dict]) -> str:
    """'identical' or where the first prompt diverges, with its gap against the dtype's resolution."""
    diverged = [r for r in rows if not r["identical"]]
    if not diverged:
        return f"identical ({len(rows)} prompts x {rows[0]['tokens']} tokens)" if rows else "not run"
    r = min(diverged, key=lambda r: r["step"])
    why = "below" if abs(r["gap"]) < r["resolution"] else "ABOVE"
    return (f"{len(diverged)}/{len(rows)} prompts differ; first at step {r['step']} (prompt {r['prompt']}): "
            f"logit gap {r['gap']:.4g}, {why} the resolution {r['resolution']:.3g}")


def graph_speedup(decode: dict, batch: str) -> float | None:
    times = decode.get(batch, {})
    return times["eager"] / times["graphs"] if times.get("graphs") else None


def bench_speedup(bench: dict, baseline: str = "hf_static") -> float | None:
    base = bench.get("baselines", {}).get(baseline, {})
    return bench["llmc"]["output_tok_s"] / base["output_tok_s"] if "output_tok_s" in base else None


def targets(result: dict) -> list[tuple[str, str, bool | None]]:
    """(target, what was measured, met: True/False/None when not measured) for the issue's targets."""
    out = []
    dtypes = measured(result["dtypes"])
    if "float16" in result["dtypes"]:
        rows = dtypes.get("float16", {}).get("greedy", [])
        out.append(("fp16 greedy tokens identical to torch", greedy_verdict(rows) if rows else "the fp16 part failed",
                    bool(rows) and all(r["identical"] for r in rows)))
    first = next(iter(dtypes.values()), None)
    if first:
        s = graph_speedup(first["decode"], "1")
        out.append(("CUDA graphs cut batch-1 decode >= 3x", f"{s:.2f}x" if s else "no graphs here",
                    None if s is None else s >= 3))
        floor, step = first["floor"], _best_batch1(first["decode"])
        ratio = step / floor["seconds"] if step and floor["seconds"] else None
        replay = f" (replay alone {floor['replay'] / floor['seconds']:.2f}x)" if floor.get("replay") else ""
        out.append(("batch-1 decode within 2x of the bytes floor",
                    f"{ratio:.2f}x the floor{replay}" if ratio else "-", None if ratio is None else ratio <= 2))
    default = measured(result.get("bench", {})).get("default")
    s = bench_speedup(default) if default else None
    out.append(("default workload >= 10x transformers", f"{s:.1f}x" if s else "not run", None if s is None else s >= 10))
    return out


def _best_batch1(decode: dict) -> float | None:
    times = decode.get("1")
    return min(t for t in times.values() if t) if times else None


def _ms(seconds: float | None) -> str:
    return f"{1000 * seconds:.2f}" if seconds else "-"


def _correctness(result: dict) -> list[str]:
    lines = ["correctness: candidate vs the torch backend on the same device and weights",
             f"  {'dtype':<6}{'max|dlogit|':>12}{'tolerance':>11}{'ok':>4}  greedy"]
    for dtype, d in result["dtypes"].items():
        if "error" in d:
            lines.append(f"  {SHORT[dtype]:<6}FAILED: {d['error'][:110]}")
            continue
        lg = d["logits"]
        ok = "yes" if lg["max_abs_diff"] <= lg["tolerance"] and lg["finite"] else "NO"
        lines.append(f"  {SHORT[dtype]:<6}{lg['max_abs_diff']:>12.4g}{lg['tolerance']:>11.3g}{ok:>4}  "
                     f"{greedy_verdict(d['greedy'])}")
    return lines


def _decode(result: dict) -> list[str]:
    batches = sorted({b for d in measured(result["dtypes"]).values() for b in d["decode"]}, key=int)
    lines = ["decode step, ms (metadata + copy + launches or replay + logits to host)",
             f"  {'':<14}" + "".join(f"{'batch ' + b:>11}" for b in batches)]
    for dtype, d in measured(result["dtypes"]).items():
        for mode in ("eager", "graphs"):
            lines.append(f"  {SHORT[dtype] + ' ' + mode:<14}" + "".join(f"{_ms(d['decode'][b][mode]):>11}"
                                                                      for b in batches))
        speed = [graph_speedup(d["decode"], b) for b in batches]
        lines.append(f"  {SHORT[dtype] + ' speedup':<14}" + "".join(f"{f'{s:.2f}x' if s else '-':>11}" for s in speed))
    for dtype, d in measured(result["dtypes"]).items():
        if d.get("capture"):
            c = d["capture"]
            lines.append(f"  {SHORT[dtype]} capture: {len(c['batch_sizes'])} batch sizes in {c['seconds']:.1f} s, "
                         f"{c['bytes'] / 2**30:.2f} GiB")
        if d.get("graph_error"):
            lines.append(f"  {SHORT[dtype]} capture FAILED: {d['graph_error'][:100]}")
    return lines


def _floor(result: dict) -> list[str]:
    bw = result["env"]["copy_bandwidth"]
    lines = [f"batch-1 decode against the bytes it must read (copy bandwidth {bw / 1e9:.0f} GB/s read+write)"]
    for dtype, d in measured(result["dtypes"]).items():
        f, step = d["floor"], _best_batch1(d["decode"])
        ratio = f"{step / f['seconds']:.2f}x the floor" if step else "-"
        replay = f"; graph replay alone {_ms(f['replay'])} ms = {f['replay'] / f['seconds']:.2f}x" \
            if f.get("replay") else ""
        lines.append(f"  {SHORT[dtype]:<6}{f['bytes'] / 1e6:8.1f} MB/step  floor {1e6 * f['seconds']:8.1f} us  "
                     f"best step {_ms(step)} ms = {ratio}{replay}")
    return lines


def _kernels(result: dict) -> list[str]:
    dtype, d = next(((k, v) for k, v in measured(result["dtypes"]).items() if v.get("kernels")), (None, None))
    if d is None:
        return []
    bw = result["env"]["copy_bandwidth"]
    lines = [f"kernels of one batch-1 decode step ({SHORT[dtype]}, eager, synchronised after each launch)",
             f"  {'kernel':<40}{'launches':>9}{'us/step':>10}{'MB/step':>9}{'GB/s':>8}{'% copy bw':>10}"]
    for k in d["kernels"]:
        rate = k["bytes"] / k["seconds"] if k["seconds"] else 0.0
        lines.append(f"  {k['label'][:40]:<40}{k['launches']:>9}{1e6 * k['seconds']:>10.1f}{k['bytes'] / 1e6:>9.2f}"
                     f"{rate / 1e9:>8.1f}{100 * rate / bw:>9.1f}%")
    return lines


def _bench(result: dict) -> list[str]:
    if not result.get("bench"):
        return []
    pct = lambda d: f"{1000 * d['p50']:.0f}/{1000 * d['p99']:.0f}"  # noqa: E731
    lines = ["llmc bench against transformers on the same device",
             f"  {'workload':<12}{'engine':<15}{'out tok/s':>10}{'TTFT p50/p99 ms':>17}{'TPOT p50/p99 ms':>17}"
             f"{'speedup':>9}"]
    for name, b in result["bench"].items():
        if "error" in b:
            lines.append(f"  {name:<12}FAILED: {b['error'][:110]}")
            continue
        llmc = b["llmc"]
        lines.append(f"  {name:<12}{'llmc':<15}{llmc['output_tok_s']:>10.1f}{pct(llmc['ttft_s']):>17}"
                     f"{pct(llmc['tpot_s']):>17}{'':>9}")
        for base, r in b.get("baselines", {}).items():
            if "error" in r:
                lines.append(f"  {name:<12}{base:<15} unavailable: {r['error'][:60]}")
                continue
            speed = llmc["output_tok_s"] / r["output_tok_s"]
            lines.append(f"  {name:<12}{base:<15}{r['output_tok_s']:>10.1f}{'n/a':>17}{'n/a':>17}{speed:>8.1f}x")
    return lines


def format_table(result: dict) -> str:
    """The closing table: environment, correctness, decode times, floor, kernels, bench, targets."""
    env = result["env"]
    head = (f"llmc GPU check, {env['date']}: {env['gpu']} | torch {env['torch']} | triton {env['triton']} | "
            f"transformers {env['transformers']} | candidate backend {env['backend']} on {env['device']}")
    if env.get("seconds"):
        head += "\ntime per part: " + ", ".join(f"{name} {t:.0f} s" for name, t in env["seconds"].items())
    verdicts = ["targets (what was measured; met?)"] + [
        f"  {name:<46}{measured:<40} {'-' if met is None else 'yes' if met else 'NO'}"
        for name, measured, met in targets(result)]
    sections = [[head], _correctness(result), _decode(result), _floor(result), _kernels(result), _bench(result),
                verdicts]
    return "\n\n".join("\n".join(s) for s in sections if s)

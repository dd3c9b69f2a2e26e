"""The GPU check's verdicts and its closing table, computed from the result dict alone (so CI
checks them on a CPU run with the torch backend standing in for triton).

Result layout (what tools/gpu_check_run.py fills; also written as JSON):
  env            {device, gpu, torch, triton, transformers, date, backend, copy_bandwidth, seconds}
  anchor         {float32: {artifact, scale}}
  dtypes         {dtype: {logits: judge_logits(..), greedy / greedy_torch: [greedy_against_anchor rows],
                          decode: {batch: {"eager": s, "graphs": s | None}},
                          floor: {bytes, seconds, replay}, kernels: [KernelRow dicts] (first dtype only)}}
  quant          {recipe: a dtype part + quality: {delta_perplexity_percent, mean_kl, top1_agreement,
                                                   budget_percent, ok, ...}}
  bench          {workload name: {llmc: run_llmc(..), baselines: {hf_static: numbers | {error}}}}
A part that failed is {"error": ...}; one that failed after saving some numbers keeps them beside
"interrupted".
"""

from __future__ import annotations

from .gpu_check_correct import FACTOR, FLOOR_ULPS, TIE_FACTOR

SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8", "int4": "int4", "kv8": "kv8"}
LEGEND = (f"  rule: ok when the candidate's max |logit - fp32 anchor| <= {FACTOR:g} x torch's own in the same "
          f"artifact + {FLOOR_ULPS} ulp of the dtype at the\n  anchor's largest logit (both round every op to "
          f"the dtype and differ only in summation order; torch stands for the\n  error a correct kernel makes). "
          f"greedy: picks that are not fp32's top; ok when each is within {TIE_FACTOR:g} x that bound of it.")


def measured(parts: dict) -> dict:
    """The parts (dtypes or workloads) that ran, without those that failed."""
    return {name: part for name, part in parts.items() if "error" not in part}


def model_parts(result: dict) -> dict:
    """The dtype parts and then the quantized recipes that ran."""
    return measured({**result["dtypes"], **result.get("quant", {})})


def greedy_verdict(rows: list[dict]) -> str:
    """How many picks are not fp32's top, and the largest gap there against the near-tie allowance."""
    if not rows:
        return "not run"
    off = sum(r["off_top"] for r in rows)
    if not off:
        return f"all fp32's top ({len(rows)} prompts x {rows[0]['tokens']} tokens)"
    worst = max(rows, key=lambda r: r["worst_gap"])
    return (f"{off}/{len(rows) * rows[0]['tokens']} picks not fp32's top; worst gap {worst['worst_gap']:.3g} "
            f"(prompt {worst['prompt']}, step {worst['worst_step']}), {'within' if worst['ok'] else 'ABOVE'} "
            f"the tie {worst['tie']:.3g}")


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
        logits = dtypes.get("float16", {}).get("logits")
        out.append(("fp16 logits within the fp32-anchored bound",
                    f"{logits['candidate_error']:.3g} <= {logits['bound']:.3g}" if logits else "the fp16 part failed",
                    bool(logits) and logits["ok"]))
        rows = dtypes.get("float16", {}).get("greedy", [])
        out.append(("fp16 greedy picks within fp32's near-ties",
                    greedy_verdict(rows) if rows else "the fp16 part failed",
                    bool(rows) and all(r["ok"] for r in rows)))
    for name, q in measured(result.get("quant", {})).items():
        lg, quality = q["logits"], q["quality"]
        out.append((f"{name} kernels: logits, dppl within budget",
                    f"logits {'ok' if lg['ok'] else 'NO'}, dppl {quality['kernels_delta_perplexity_percent']:+.3f}% "
                    f"(<= {quality['budget_percent']:g}%)", quality["ok"] and lg["ok"]))
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
    out.append(("default workload >= 10x transformers", f"{s:.1f}x" if s else "not run",
                None if s is None else s >= 10))
    return out


def _best_batch1(decode: dict) -> float | None:
    times = decode.get("1")
    return min(t for t in times.values() if t) if times else None


def _ms(seconds: float | None) -> str:
    return f"{1000 * seconds:.2f}" if seconds else "-"


def _correctness(result: dict) -> list[str]:
    lines = ["correctness: max |logit - fp32 anchor| (torch backend, fp32, same device, prompts and forced tokens; "
             "a recipe's anchor is the recipe in fp32)",
             f"  {'part':<6}{'candidate':>10}{'torch':>9}{'bound':>9}{'ok':>4}  greedy (candidate; torch)"]
    for name, d in {**result["dtypes"], **result.get("quant", {})}.items():
        if "error" in d:
            lines.append(f"  {SHORT[name]:<6}FAILED: {d['error'][:110]}")
            continue
        lg = d["logits"]
        ok = "yes" if lg["ok"] else "NO"
        lines.append(f"  {SHORT[name]:<6}{lg['candidate_error']:>10.4g}{lg['torch_error']:>9.4g}{lg['bound']:>9.3g}"
                     f"{ok:>4}  {greedy_verdict(d['greedy'])}; torch {_off_top(d['greedy_torch'])}")
    return lines + [LEGEND]


def _off_top(rows: list[dict]) -> str:
    return f"{sum(r['off_top'] for r in rows)}/{sum(r['tokens'] for r in rows)} off" if rows else "not run"


def _quality(result: dict) -> list[str]:
    parts = measured(result.get("quant", {}))
    if not parts:
        return []
    first = next(iter(parts.values()))["quality"]
    lines = [f"quantized recipes in {SHORT[first['dtype']]}: dppl % and mean KL on {first['positions']} tokens of held "
             "text against the unquantized fp32 anchor (`llmc eval`'s measure); ok when the kernels' share, candidate "
             "minus torch, is within the budget",
             f"  {'recipe':<7}{'kernels':>9}{'budget':>8}{'ok':>4}{'candidate':>11}{'mean KL':>10}{'top-1':>8}"
             f"{'torch':>9}{'recipe in fp32 (these weights only)':>37}"]
    for name, q in parts.items():
        r = q["quality"]
        alone = r["recipe_delta_perplexity_percent"]
        within = "within" if abs(alone) <= r["budget_percent"] else "OUTSIDE"
        lines.append(f"  {name:<7}{r['kernels_delta_perplexity_percent']:>+9.3f}{r['budget_percent']:>8g}"
                     f"{'yes' if r['ok'] else 'NO':>4}{r['delta_perplexity_percent']:>+11.3f}{r['mean_kl']:>10.4g}"
                     f"{r['top1_agreement']:>8.3f}{r['torch_delta_perplexity_percent']:>+9.3f}"
                     f"{f'{alone:+.3f} ({within} the budget)':>37}")
    return lines


def _decode(result: dict) -> list[str]:
    batches = sorted({b for d in model_parts(result).values() for b in d["decode"]}, key=int)
    lines = ["decode step, ms (metadata + copy + launches or replay + logits to host)",
             f"  {'':<14}" + "".join(f"{'batch ' + b:>11}" for b in batches)]
    for dtype, d in model_parts(result).items():
        for mode in ("eager", "graphs"):
            lines.append(f"  {SHORT[dtype] + ' ' + mode:<14}" + "".join(f"{_ms(d['decode'][b][mode]):>11}"
                                                                      for b in batches))
        speed = [graph_speedup(d["decode"], b) for b in batches]
        lines.append(f"  {SHORT[dtype] + ' speedup':<14}" + "".join(f"{f'{s:.2f}x' if s else '-':>11}" for s in speed))
    for dtype, d in model_parts(result).items():
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
    for dtype, d in model_parts(result).items():
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
    how = ("device time from CUDA events, no synchronisation between launches" if result["env"]["device"] == "cuda"
           else "wall time of each launch")
    lines = [f"kernels of one batch-1 decode step ({SHORT[dtype]}, eager; {how})",
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
        if b.get("interrupted"):
            lines.append(f"  {name:<12}interrupted after llmc's run: {b['interrupted'][:90]}")
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
    sections = [[head], _correctness(result), _quality(result), _decode(result), _floor(result), _kernels(result),
                _bench(result), verdicts]
    return "\n\n".join("\n".join(s) for s in sections if s)

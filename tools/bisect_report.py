"""Text form of a `BisectReport` (tools/bisect.py): the per-stage table, the culprit, greedy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .bisect import FACTOR

if TYPE_CHECKING:
    from .bisect import BisectReport, GreedyCheck

NAME_WIDTH = 26
CELL_WIDTH = 20


def _table(report: "BisectReport") -> list[str]:
    by_stage: dict[int, dict] = {}
    tolerances: dict[str, float] = {}
    for check in report.checks:
        by_stage.setdefault(check.stage.index, {"stage": check.stage})[check.probe] = check
        tolerances[check.probe] = check.tolerance
    header = "  " + "stage".ljust(NAME_WIDTH) + "".join(p.ljust(CELL_WIDTH) for p in report.probes)
    tols = "  " + "(tolerance)".ljust(NAME_WIDTH) + "".join(f"{tolerances[p]:.1e}".ljust(CELL_WIDTH)
                                                         for p in report.probes)
    lines = [header, tols]
    for row in by_stage.values():
        stage = row["stage"]
        cells = [(f"{row[p].error:.1e}" + ("  DIVERGED" if row[p].diverged else "")).ljust(CELL_WIDTH)
                 for p in report.probes]
        lines.append("  " + f"{stage.index:02d} {stage.name}".ljust(NAME_WIDTH) + "".join(cells))
    return lines


def _culprit(report: "BisectReport") -> list[str]:
    culprit = report.culprit
    if culprit is None:
        return ["no pass changes the logits beyond the tolerance"]
    check = culprit.check
    lines = [f"first divergence: pass {check.stage.name} changes the logits of the {check.probe} probe "
             f"by {check.error:.3g} (tolerance {check.tolerance:.1e})"]
    if culprit.node_before is None and check.stage.ranks is not None:
        lines.append(f"  no value all {check.stage.ranks.plan.size} ranks hold whole differs before the logits; the "
                     "ranks' heads and partial sums cannot be matched to unsharded values, so only the pass is named")
        return lines
    if culprit.node_before is None:
        lines.append("  no intermediate value could be matched across the pass; only the output differs")
        return lines
    lines += [f"  first value that differs, before the pass: {culprit.node_before}",
              f"  after the pass it is computed by:          {culprit.node_after}",
              f"  max abs error {culprit.node_error:.3g} (tolerance {culprit.node_tolerance:.1e})"]
    return lines


def _greedy_line(report: "BisectReport", check: "GreedyCheck") -> str:
    steps = len(check.reference)
    flip = check.first_flip
    if flip is None:
        return f"greedy decode of the chat prompt after {check.stage}: all {steps} tokens match the traced graph"
    want, got = check.reference[flip], check.tokens[flip]
    return (f"greedy decode of the chat prompt after {check.stage}: the token first flips at decode step {flip} "
            f"(traced {want} {report.token_text.get(want, '')!r}, now {got} {report.token_text.get(got, '')!r})")


def render(report: "BisectReport") -> str:
    ranks = f", {report.tp} ranks in lockstep from the shard pass on" if report.tp > 1 else ""
    lines = [f"llmc debug bisect: {report.model} ({report.dtype}{ranks}); max abs error of the logits against "
             "the traced graph run in float64; a stage diverges beyond the tolerance, "
             f"{FACTOR:g}x the traced graph's own error in {report.dtype}"]
    lines += _table(report)
    lines += _culprit(report)
    lines += [_greedy_line(report, g) for g in report.greedy]
    return "\n".join(lines) + "\n"

"""The batched sampler: one pass over a step's sampled logit rows [N, vocab], where the logits are.

Per row, in the order and with the float operations of the per-row reference (sampler.py, vLLM's
order): repetition / frequency / presence penalties -> log-probabilities for reporting -> greedy
argmax (temperature 0), or temperature -> top-k -> top-p -> min-p -> one inverse-CDF draw. Each
step is one tensor operation over every row that needs it, with per-row parameters as [N] tensors
on the logits' device (a row whose parameter is off gets the value that leaves it unchanged, or is
left out by a mask), so no row is cloned on its own and no Python loop runs over the vocabulary.
What comes back to the host is small: a token id per row, and the logprobs asked for.

Seeds and random streams (why a seeded request gives the same tokens as before batching): a
sampling request owns a `torch.Generator` (CPU) seeded with its seed (`sampler.make_generator`; a
request without a seed gets a random one). Every token drawn for it takes exactly one float64
uniform u from that generator, drawn on the host in the request's own token order (`uniforms`:
`torch.rand(n, dtype=float64)` yields the same numbers as n successive scalar draws), and the token
is the first index whose float64 cumulative probability (summed in vocabulary order) reaches u,
as `sampler.draw_token` picks it. The stream a request consumes is thus one number per token,
whatever else is in the batch and whatever device holds the logits: on the CPU the batched rows
equal the per-row sampler's bit for bit (same kernels per row); on a GPU the softmax and
cumulative sums are summed in another order, so a draw can differ only where u falls within
float rounding of a boundary between two tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.kernels.argmax import argmax_rows

from .sampler import SampleResult
from .sampling_params import SamplingParams

NEG_INF = float("-inf")
TOP_P_CANDIDATES = (64, 1024)  # partial sorts top-p tries, widening, before a row takes a full sort
CPU_PASS_BYTES = 2**20        # a CPU pass's float64 [rows, vocab] working set: about one core's L2 cache


@dataclass(frozen=True)
class SamplingRow:
    """One logit row to sample: its request's parameters, the token history its penalties see
    (prompt ids; output ids so far, with a verify row's earlier drafts appended), and its uniform
    (None for a greedy row)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    uniform: float | None = None


def uniforms(generator: torch.Generator | None, n: int) -> list[float | None]:
    """The next n uniforms of a request's stream (float64, in [0, 1)); None per row when greedy."""
    if generator is None:
        return [None] * n
    return torch.rand(n, generator=generator, dtype=torch.float64).tolist()


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-row parameter as a [N, 1] tensor on the logits' device (copied from the host once)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)[:, None]


def _history_pairs(histories: list[list[int]], vocab: int, device: torch.device,
                   counted: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The distinct (row, token) pairs of each row's history ids as two [P] index tensors, and with
    `counted` how often each pair occurs (fp32 [P]), found on the logits' device."""
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(histories)), lengths).to(device, non_blocking=True)
    tokens = torch.tensor([t for h in histories for t in h], dtype=torch.long).to(device, non_blocking=True)
    keys, counts = torch.unique(rows * vocab + tokens, return_counts=True)
    return keys // vocab, keys % vocab, counts.float() if counted else None


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output) penalties on [N, vocab]
    rows, out of place; a row with none of them comes out unchanged. Only the logits of tokens in
    a row's history change (the reference subtracts 0 from the others), so only those are read."""
    device, vocab = logits.device, logits.shape[1]
    repetition = [r.params.repetition_penalty for r in rows]
    frequency = [r.params.frequency_penalty for r in rows]
    presence = [r.params.presence_penalty for r in rows]
    if all(p == 1.0 for p in repetition) and not any(frequency) and not any(presence):
        return logits
    logits = logits.clone()
    if any(p != 1.0 for p in repetition):
        row, token, _ = _history_pairs([r.prompt_ids + r.output_ids if p != 1.0 else [] for r, p in
                                        zip(rows, repetition)], vocab, device)
        penalty = torch.tensor(repetition, dtype=torch.float32).to(device, non_blocking=True)[row]
        picked = logits[row, token]
        logits[row, token] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if any(frequency) or any(presence):
        row, token, counts = _history_pairs([r.output_ids if f or p else [] for r, f, p in
                                             zip(rows, frequency, presence)], vocab, device, counted=True)
        f = torch.tensor(frequency, dtype=torch.float32).to(device, non_blocking=True)[row]
        p = torch.tensor(presence, dtype=torch.float32).to(device, non_blocking=True)[row]
        logits[row, token] -= f * counts + p * (counts > 0).float()
    return logits


def _top_k(logits: torch.Tensor, top_k: list[int], k_on: list[bool]) -> torch.Tensor:
    """Top-k: keep values >= each row's k-th largest (k of 0 or >= vocab: off), from one partial sort."""
    best = torch.topk(logits, max(k for k, on in zip(top_k, k_on) if on), dim=-1).values
    return logits.masked_fill(logits < _kth_values(best, top_k, k_on), NEG_INF)


def _top_p(logits: torch.Tensor, top_p: list[float], p_on: list[bool]) -> torch.Tensor:
    """Top-p as `sampler.top_p_drop` cuts each row (1.0: off): the first token, by descending
    probability, where the running mass reaches p, and every less likely token dropped. A row's
    running mass comes from its most likely 64, else 1024 tokens (partial sorts: 2.6 and 14 ms
    for 64 rows of 49152 on a 2-core AMD EPYC, against 109 ms for a full sort), else from a full
    sort of that row alone; ties share a fate, so each gives the reference's cut exactly."""
    device, vocab = logits.device, logits.shape[1]
    probs = torch.softmax(logits, dim=-1)
    p = _column(top_p, torch.float32, device)
    on = _column(p_on, torch.bool, device)
    threshold = torch.full_like(p, float("nan"))                                      # [N, 1]
    rows = torch.nonzero(on.squeeze(1)).squeeze(1)
    partial = [c for c in TOP_P_CANDIDATES if c < vocab] if logits.device.type == "cpu" else []   # a GPU sorts fast
    for c in partial + [vocab]:
        if not rows.numel():
            break
        head = torch.topk(probs[rows], c, dim=-1).values if c < vocab else \
            torch.sort(probs[rows], dim=-1, descending=True).values                    # [rows, c] descending
        floor = _nucleus_floor(head, p[rows])
        threshold[rows] = floor if c < vocab else floor.nan_to_num(0.0)      # a full row short of p: keep all
        rows = rows[floor.isnan().squeeze(1)]
    return logits.masked_fill((probs < threshold) & on, NEG_INF)


def _nucleus_floor(ordered: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[N, 1]: per row of probabilities sorted descending ([N, C], the first C of the row), the
    probability of the token where the running mass reaches p; NaN where the C do not reach it."""
    mass = ordered.cumsum(dim=-1)
    cut = torch.searchsorted(mass, p)                                                  # [N, 1]
    floor = ordered.gather(1, cut.clamp(max=ordered.shape[1] - 1))
    return torch.where(cut < ordered.shape[1], floor, float("nan"))


def _kth_values(descending: torch.Tensor, top_k: list[int], k_on: list[bool]) -> torch.Tensor:
    """[N, 1]: each row's k-th largest value from its values sorted descending (-inf where top-k is off)."""
    device = descending.device
    kth = descending.gather(1, _column([k - 1 if on else 0 for k, on in zip(top_k, k_on)], torch.long, device))
    return torch.where(_column(k_on, torch.bool, device), kth, NEG_INF)


def filter_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (-inf) on [N, vocab] sampled rows."""
    device, vocab = logits.device, logits.shape[1]
    params = [r.params for r in rows]
    logits = logits / _column([p.temperature for p in params], torch.float32, device)
    top_k, top_p = [p.top_k for p in params], [p.top_p for p in params]
    if any(k_on := [0 < k < vocab for k in top_k]):
        logits = _top_k(logits, top_k, k_on)
    if any(p_on := [p < 1.0 for p in top_p]):
        logits = _top_p(logits, top_p, p_on)
    min_p = [p.min_p for p in params]
    if any(min_p):                       # min_p 0 masks nothing: no probability is below 0
        probs = torch.softmax(logits, dim=-1)
        floor = _column(min_p, torch.float32, device) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, NEG_INF)
    return logits


def draw_tokens(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws [N] from filtered rows [N, vocab] with one float64 uniform each ([N]): the
    first token whose cumulative probability reaches u; past the end (u above the rounded total),
    the last token with any probability, as `sampler.draw_token` walks back to it."""
    probs = torch.softmax(logits, dim=-1)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)                  # as probs.double().cumsum(): one pass
    index = torch.searchsorted(cdf, u[:, None]).squeeze(1)                             # [N]
    past = index >= logits.shape[1]                         # rare: u above the rounded total
    if logits.device.type == "cpu" and not bool(past.any()):   # on a CPU the check costs no sync
        return index
    positions = torch.arange(logits.shape[1], device=logits.device)
    last_kept = torch.where(probs > 0, positions, -1).amax(dim=-1)                      # [N]
    return torch.where(past, last_kept, index)


def sample_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [N] (on the logits' device) for fp32 rows [N, vocab], and the penalised rows that
    logprobs are read from."""
    penalised = apply_penalties(logits, rows)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not sampled:
        return argmax_rows(penalised), penalised
    picked = [rows[i] for i in sampled]
    u = torch.tensor([r.uniform for r in picked], dtype=torch.float64).to(logits.device, non_blocking=True)
    if len(sampled) == len(rows):
        return draw_tokens(filter_logits(penalised, picked), u), penalised
    index = torch.tensor(sampled).to(logits.device, non_blocking=True)
    drawn = draw_tokens(filter_logits(penalised[index], picked), u)
    return argmax_rows(penalised).index_copy(0, index, drawn), penalised


def logprobs_of(logprobs: torch.Tensor, tokens: torch.Tensor, most: int) -> tuple[list[float], list, list]:
    """On the host: each row's chosen token's logprob, and its `most` best (ids, values) lists."""
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if most:
        top = torch.topk(logprobs, min(most, logprobs.shape[1]), dim=-1)
        return chosen.tolist(), top.indices.tolist(), top.values.tolist()
    return chosen.tolist(), [[]] * len(tokens), [[]] * len(tokens)


def top_pairs(ids: list[int], values: list[float], n: int) -> tuple[tuple[int, float], ...]:
    """The best n (id, logprob) pairs; tokens a grammar banned (-inf) are never listed."""
    return tuple((t, v) for t, v in zip(ids[:n], values[:n]) if v != NEG_INF)


def rows_per_pass(logits: torch.Tensor, rows: list[SamplingRow]) -> int:
    """Rows sampled together: all of them on a GPU or when all are greedy (an argmax streams through
    them once); on a CPU as many as keep one float64 copy of the rows ([rows, vocab], the CDF's)
    within a core's cache when any row draws. A pass over rows larger than the cache runs at memory
    speed: on a shared 2-core AMD EPYC (1 thread, 64 rows of 49152) one pass over all rows took
    1.5-3x the per-row sampler's time, passes of 1 MiB about the same time as it (0.85-1.25x)."""
    if logits.device.type != "cpu" or all(r.params.greedy for r in rows):
        return logits.shape[0]
    return max(1, CPU_PASS_BYTES // (8 * logits.shape[1]))


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
    """One token per fp32 row of `logits` [N, vocab] (any device; grammar masks already applied),
    with logprobs where a row's request asks; the same results as `sampler.sample_row` per row."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows were given for {len(rows)} sampling rows; give one each")
    step = max(1, rows_per_pass(logits, rows))
    return [result for i in range(0, len(rows), step) for result in _sample_pass(logits[i:i + step], rows[i:i + step])]


def _sample_pass(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
    """`sample_rows` for rows sampled in one pass."""
    tokens, penalised = sample_tokens(logits.float(), rows)
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    results = [SampleResult(t) for t in tokens.tolist()]
    if wanted:
        index = torch.tensor(wanted).to(logits.device, non_blocking=True)
        most = max(rows[i].params.logprobs for i in wanted)
        chosen, ids, values = logprobs_of(torch.log_softmax(penalised[index], dim=-1), tokens[index], most)
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs
            results[i] = SampleResult(results[i].token_id, chosen[j], top_pairs(ids[j], values[j], n))
    return results

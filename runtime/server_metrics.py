"""Prometheus metrics of one server, in a registry of its own (no process-global state).

Counted when a request ends (in the engine loop's thread, through `observe_finished`):
requests by outcome (stop, length, abort, error), prompt and generated tokens, and the TTFT,
TPOT and end-to-end latency histograms. Refused HTTP requests are counted by status. The
engine's gauges (running and waiting requests, KV blocks used and free, prefix-cache hit rate)
and its preemption and step counters are read from the loop's latest stats at scrape time, and
so are, when it speculates, its speculative decoding counters (drafted and accepted tokens, per
draft position too, draft and verify time, acceptance rate, mean accepted length) and the
grammar masks' rows and time (structured output).
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .engine import EngineStats
from .request import RequestOutput
from .speculative.speculator import SpeculationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Gauges and counters from the engine loop's stats snapshot, read at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        for name, doc, value in [
            ("llmc_num_requests_running", "Requests being computed", s.running),
            ("llmc_num_requests_waiting", "Requests waiting to be scheduled", s.waiting),
            ("llmc_kv_blocks_used", "KV cache blocks in use", s.kv_blocks_used),
            ("llmc_kv_blocks_free", "KV cache blocks free", s.kv_blocks_free),
            ("llmc_prefix_cache_hit_rate", "Share of looked-up prompt blocks found in the prefix cache",
             s.prefix_cache_hit_rate),
        ]:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("llmc_preemptions", "Sequences preempted for KV space", value=s.preemptions)
        yield CounterMetricFamily("llmc_engine_steps", "Engine steps run", value=s.steps)
        yield CounterMetricFamily("llmc_grammar_masked_rows", "Logit rows a grammar masked", value=s.grammar_rows)
        yield CounterMetricFamily("llmc_grammar_mask_seconds", "Time filling and applying grammar masks",
                                  value=s.grammar_mask_seconds)
        if s.speculation is not None:
            yield from _speculation_metrics(s.speculation)


def _speculation_metrics(spec: SpeculationStats) -> Iterator[Metric]:
    for name, doc, value in [
        ("llmc_spec_draft_tokens", "Speculative tokens drafted", spec.drafted),
        ("llmc_spec_accepted_tokens", "Drafted tokens accepted by verification", spec.accepted),
        ("llmc_spec_verified_sequences", "Sequence-steps that verified drafts", spec.verified_seqs),
        ("llmc_spec_emitted_tokens", "Tokens those sequence-steps gave (accepted + the target's own)", spec.emitted),
        ("llmc_spec_draft_seconds", "Time spent drafting", spec.draft_seconds),
        ("llmc_spec_verify_seconds", "Time of target steps that verified drafts", spec.verify_seconds),
    ]:
        yield CounterMetricFamily(name, doc, value=value)
    yield GaugeMetricFamily("llmc_spec_acceptance_rate", "Accepted / drafted tokens", value=spec.acceptance_rate)
    yield GaugeMetricFamily("llmc_spec_mean_accepted_length", "Tokens a verifying sequence gained per step",
                            value=spec.mean_accepted_length)
    per_position = CounterMetricFamily("llmc_spec_accepted_tokens_per_position",
                                       "Drafts accepted, by their position in the draft (0 first)", labels=["position"])
    for position, accepted in enumerate(spec.accepted_at):
        per_position.add_metric([str(position)], accepted)
    yield per_position


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmc_requests", "Engine requests ended, by outcome", ["outcome"], registry=r)
        self.rejected = Counter("llmc_rejected_requests", "HTTP requests refused, by status", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("llmc_prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter("llmc_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("llmc_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llmc_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("llmc_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)

    def watch_engine(self, stats: Callable[[], EngineStats]) -> None:
        self.registry.register(_EngineCollector(stats))

    def observe_finished(self, out: RequestOutput) -> None:
        self.requests.labels(out.finish_reason or "abort").inc()
        m = out.metrics
        if m is None:               # ended before the engine took it
            return
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.output_tokens)
        if m.output_tokens:
            self.ttft.observe(m.ttft)
            self.e2e.observe(m.e2e)
        if m.output_tokens > 1:
            self.tpot.observe(m.tpot)

    def observe_rejected(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

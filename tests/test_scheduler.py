"""Scheduler on plain integers, driven by tests/sim.py's deterministic stand-in model."""

from __future__ import annotations

import random

from llmc.runtime.sequence import SequenceStatus
from sim import Simulation, make_seq, reference_output


def assert_no_leak(sim: Simulation) -> None:
    bm = sim.blocks
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_every_request_finishes_with_its_own_output_and_no_block_leaks():
    rng = random.Random(0)
    seqs = [make_seq(i, rng.randint(1, 70), rng.randint(1, 30)) for i in range(20)]
    sim = Simulation(num_blocks=64)
    sim.run(seqs)
    for s in seqs:
        assert s.output_ids == reference_output(s)
    assert_no_leak(sim)


def test_steps_respect_token_budget_and_seat_limit():
    seqs = [make_seq(i, 50, 10) for i in range(12)]
    sim = Simulation(num_blocks=128, max_num_seqs=5, max_batched_tokens=64)
    sim.run(seqs)
    for step in sim.steps:
        assert sum(c.end - c.start for c in step.chunks) <= 64
        assert len(step.chunks) <= 5


def test_long_prompt_is_chunked_while_decodes_keep_flowing():
    sim = Simulation(num_blocks=256, max_batched_tokens=32)
    short = make_seq(0, 5, 60)
    sim.scheduler.add(short)
    sim.step()                                     # short's prefill
    long = make_seq(1, 300, 2)
    sim.scheduler.add(long)
    prefill_steps = 0
    while long.num_computed < long.num_tokens - 1 or not long.output_ids:
        step = sim.step()
        by_seq = {c.seq.seq_id: c for c in step.chunks}
        assert 0 in by_seq and by_seq[0].end - by_seq[0].start == 1   # short decoded this step
        assert by_seq[1].end - by_seq[1].start <= 31
        prefill_steps += 1
    assert prefill_steps == -(-300 // 31)
    assert any(len(s.chunks) == 2 and not s.is_pure_decode for s in sim.steps)


def test_preempted_requests_finish_with_the_same_output():
    rng = random.Random(1)
    seqs = [make_seq(i, rng.randint(10, 40), rng.randint(20, 40)) for i in range(10)]
    sim = Simulation(num_blocks=14, block_size=8, max_num_seqs=8, max_batched_tokens=48)
    sim.run(seqs)
    assert sim.scheduler.num_preemptions > 0
    assert any(s.num_preemptions for s in seqs)
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED
        assert s.output_ids == reference_output(s)
    assert_no_leak(sim)


def test_aborting_running_and_waiting_requests_frees_everything():
    seqs = [make_seq(i, 30, 50) for i in range(6)]
    sim = Simulation(num_blocks=40, max_num_seqs=3)
    for s in seqs:
        sim.scheduler.add(s)
    for _ in range(5):
        sim.step()
    assert sim.scheduler.running and sim.scheduler.waiting
    for s in seqs:
        if not s.is_finished:
            sim.scheduler.finish(s)
    assert not sim.scheduler.has_work()
    assert_no_leak(sim)


def test_shared_system_prompt_is_served_from_the_prefix_cache():
    base = list(range(64))                          # a 64-token "system prompt": 4 blocks
    seqs = [make_seq(i, 10, 5) for i in range(4)]
    for s in seqs:
        s.prompt_ids = base + s.prompt_ids
    sim = Simulation(num_blocks=64, max_batched_tokens=512)
    sim.run(seqs[:1])
    sim.run(seqs[1:])
    assert [s.num_cached_prompt for s in seqs] == [0, 64, 64, 64]
    assert sim.blocks.hit_rate() > 0.5
    for s in seqs:
        assert s.output_ids == reference_output(s)
    assert_no_leak(sim)


def test_lower_priority_value_is_admitted_first():
    sim = Simulation(num_blocks=64, max_num_seqs=1)
    late_urgent = make_seq(1, 8, 2, priority=-1)
    early = make_seq(0, 8, 2)
    sim.scheduler.add(early)
    sim.scheduler.add(late_urgent)
    first = sim.step()
    assert [c.seq.seq_id for c in first.chunks] == [1]


def test_without_chunked_prefill_a_long_prompt_is_computed_whole():
    sim = Simulation(num_blocks=256, max_batched_tokens=32, chunked_prefill=False)
    short, long = make_seq(0, 5, 3), make_seq(1, 300, 2)
    sim.scheduler.add(short)
    sim.step()
    sim.scheduler.add(long)
    while not short.is_finished:
        step = sim.step()
        assert [c.seq.seq_id for c in step.chunks] == [0]       # the long prompt waits
    step = sim.step()
    assert [(c.seq.seq_id, c.start, c.end) for c in step.chunks] == [(1, 0, 300)]
    sim.run([])
    assert long.output_ids == reference_output(long)

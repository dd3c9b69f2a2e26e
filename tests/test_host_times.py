"""HostTimes (runtime/host_times.py): the engine's per-phase host clocks and their snapshots."""

from __future__ import annotations

from dataclasses import fields

from llmc.runtime.host_times import HOST_PHASES, HostTimes


def test_a_snapshot_copies_every_field_and_stays_as_it_was():
    times = HostTimes(**{f.name: i + 1 for i, f in enumerate(fields(HostTimes))})
    copy = times.snapshot()
    assert copy == times and copy is not times
    times.steps += 1
    with times.timed("build"):
        pass
    assert copy.steps == 1 and copy.build == 3 and times.since(copy).steps == 1


def test_per_step_means_and_host_sum_the_host_phases():
    times = HostTimes(steps=2, compute=4.0, wait=1.0, **{p: 2.0 for p in HOST_PHASES})
    per_step = times.per_step()
    assert per_step["compute"] == 2.0 and per_step["host"] == len(HOST_PHASES) * 1.0

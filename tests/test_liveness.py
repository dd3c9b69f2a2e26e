"""Value liveness (runtime/liveness.py), on integers: a value dies after its last reader, an
unread one where it is made, a kept one never; each once, in the order its launch names it."""

from __future__ import annotations

from llmc.runtime.liveness import dying_after


def test_each_value_dies_after_its_last_reader():
    launches = [((0,), (1,)),          # 1 = f(0)
                ((1, 0), (2, 3)),      # 2, 3 = g(1, 0); 3 is never read
                ((2,), (4,)),          # 4 = h(2)
                ((4, 2), (5,))]        # 5 = k(4, 2)
    assert dying_after(launches) == [(), (1, 0, 3), (), (4, 2, 5)]


def test_kept_values_never_die():
    launches = [((0,), (1,)), ((1,), (2,))]
    assert dying_after(launches, keep={0, 2}) == [(), (1,)]


def test_a_value_read_twice_by_one_launch_is_named_once():
    assert dying_after([(("x", "x"), ("y",))]) == [("x", "y")]

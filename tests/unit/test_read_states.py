"""The read state of each owned stream (consumer/read_states.py): what may move a stream to
``readable``, and that every epoch change or interruption sends it back to ``draining``."""

from __future__ import annotations

from outbox_relay.consumer.read_states import DRAINING, READABLE, ReadStates


def test_a_stream_starts_draining_and_a_completed_pass_makes_it_readable() -> None:
    states, held = ReadStates(), {"k0": 1, "k1": 1}
    assert states.draining(["k0", "k1", "k2"], held) == ["k0", "k1"]
    assert states.state("k2", held) is None  # not held
    started = states.begin_pass(["k0", "k1"], held)
    assert states.move(["k0"], READABLE, held, started=started) == ["k0"]
    assert states.readable(["k0", "k1"], held) == ["k0"]


def test_readable_only_with_the_pass_that_drained_it() -> None:
    states, held = ReadStates(), {"k0": 1}
    assert states.move(["k0"], READABLE, held) == []  # no pass: refused
    other = ReadStates().begin_pass(["k0"], held)
    started = states.begin_pass(["k0"], held)
    states.move(["k0"], DRAINING, held, why="a batch did not complete")
    assert states.move(["k0"], READABLE, held, started=started) == []
    assert states.move(["k0"], READABLE, held, started=other) == []
    assert states.state("k0", held) == DRAINING


def test_an_epoch_change_during_the_pass_or_after_it_means_draining() -> None:
    states, held = ReadStates(), {"k0": 1, "k1": 1}
    started = states.begin_pass(["k0", "k1"], held)
    held["k0"] = 2  # a renewal inside the pass gave k0 back under a new epoch
    assert not states.covers(started, "k0", held)
    assert states.move(["k0", "k1"], READABLE, held, started=started) == ["k1"]
    assert states.state("k0", held) == DRAINING
    held["k1"] = 2  # given up and got back after the pass: no move needed to see it
    assert states.state("k1", held) == DRAINING
    del held["k0"]
    assert states.state("k0", held) is None


def test_a_new_pass_makes_a_readable_stream_draining_until_it_completes() -> None:
    states, held = ReadStates(), {"k0": 1}
    states.move(["k0"], READABLE, held, started=states.begin_pass(["k0"], held))
    assert states.state("k0", held) == READABLE
    started = states.begin_pass(["k0"], held)
    assert states.state("k0", held) == DRAINING  # the pass clears the blocked aggregates
    states.move(["k0"], READABLE, held, started=started)
    assert states.state("k0", held) == READABLE

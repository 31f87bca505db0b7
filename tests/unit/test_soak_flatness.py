"""The soak's flatness verdict (torture/soak.py ``flatness``): stream lengths sampled at any
point of the trim's cycle swing with nothing growing, so they are compared from the trim's own
ceiling up (``stream_ceiling``); a series that keeps growing is still ``growing``."""

from __future__ import annotations

from torture.soak import QUICK, Sample, flatness, stream_ceiling


def _samples(stream_entries: list[int]) -> list[Sample]:
    return [Sample(t_s=60.0 + 5 * i, enqueued=0, rate=300.0, backlog=0, unreceived=0,
                   outbox_events=100, outbox_inbox=100, outbox_inbox_heads=10,
                   stream_entries=n, dead_letters=0, consumers=2)
            for i, n in enumerate(stream_entries)]


def test_the_quick_soaks_ceiling_is_seven_seconds_of_load() -> None:
    assert stream_ceiling(QUICK, 300.0) == 2100.0  # keep 0, 5 s kept, a trim every 2 s


def test_a_trim_cycle_seen_at_its_low_then_its_high_is_flat_under_the_ceiling() -> None:
    # Sampled every 5 s against a 2 s trim: the middle third saw only the cycle's lows.
    entries = [1500, 1520, 1510, 1500, 1530, 1510, 1800, 2090, 1790]
    plain = flatness(_samples(entries), warm_up=0)
    assert plain["verdict"] == "growing"  # 2090 > 1.2 x 1530
    ceiled = flatness(_samples(entries), warm_up=0, least={"stream_entries": 2100.0})
    assert ceiled["verdict"] == "flat"
    assert ceiled["series"]["stream_entries"]["compared_to"] == 2100.0


def test_growth_past_the_ceiling_is_still_growing() -> None:
    entries = [1500, 1900, 2000, 2100, 2300, 2400, 2700, 2900, 3100]
    verdict = flatness(_samples(entries), warm_up=0, least={"stream_entries": 2100.0})
    assert verdict["verdict"] == "growing"
    assert not verdict["series"]["stream_entries"]["flat"]

"""The torture's ghost consumer (torture/ghost.py): what its late commands do to a group."""

from __future__ import annotations

import random
from typing import Any, cast

import fakeredis
import pytest
import redis

from torture.ghost import GHOST_CLAIM, GHOST_READ, Ghost

KEY, GROUP = "ghost:stream", "g"


def pending_by_consumer(client: redis.Redis) -> dict[str, int]:
    summary = client.xpending(KEY, GROUP)
    return {c["name"].decode(): int(c["pending"]) for c in summary["consumers"] or []}


@pytest.fixture
def client() -> redis.Redis:
    c = fakeredis.FakeRedis()
    for i in range(10):
        c.xadd(KEY, {"n": str(i)})
    c.xgroup_create(KEY, GROUP, id="0")
    return c


def test_a_ghost_claims_pending_entries_away_from_their_owner_or_reads_new_ones(
    client: redis.Redis,
) -> None:
    client.xreadgroup(GROUP, "owner", {KEY: ">"}, count=6)  # 6 pending for the owner, 4 new
    ghost = Ghost(lambda: client, [(KEY, GROUP)], every_s=1, seed=1)
    rng = random.Random(7)
    seen = set()
    taken_from_owner = False
    for _ in range(40):
        before = pending_by_consumer(client)
        done = ghost.haunt(rng, for_s=0)
        after = pending_by_consumer(client)
        ghosts = sum(n for name, n in after.items() if name.startswith("ghost-"))
        if done == GHOST_CLAIM:  # moved, never acknowledged: the group's total is the same
            assert after.get("owner", 0) <= before.get("owner", 0)
            assert sum(after.values()) == sum(before.values())
            if before == {"owner": 6}:  # the first claim: it can only come from the owner
                assert after["owner"] < 6
                taken_from_owner = True
        elif done == GHOST_READ:  # new entries now pending for a ghost
            assert sum(after.values()) > sum(before.values())
        else:
            assert after == before
        assert ghosts == sum(after.values()) - after.get("owner", 0)
        seen.add(done)
    assert {GHOST_CLAIM, GHOST_READ} <= seen and taken_from_owner
    assert sum(pending_by_consumer(client).values()) == 10  # every entry read, none acked


def test_a_ghost_without_a_group_or_redis_does_nothing() -> None:
    empty = fakeredis.FakeRedis()
    assert Ghost(lambda: empty, [("nowhere", GROUP)], every_s=1, seed=1).haunt(
        random.Random(1), for_s=0.05) is None

    def down() -> redis.Redis:
        raise redis.ConnectionError("down")

    assert Ghost(down, [(KEY, GROUP)], every_s=1, seed=1).haunt(random.Random(1), for_s=0) is None


def test_a_ghost_aims_at_the_entries_waiting_for_a_retry_when_told_which(
    client: redis.Redis,
) -> None:
    got = client.xreadgroup(GROUP, "owner", {KEY: ">"}, count=6)
    ids = [i.decode() for i, _ in got[0][1]]
    blocker = ids[3]  # not among the oldest: only the retry table names it
    ghost = Ghost(lambda: client, [(KEY, GROUP)], every_s=1, seed=1,
                  blockers=lambda: [(KEY, GROUP, blocker)])
    rng = random.Random(3)
    for _ in range(50):  # half the bursts aim (the rest are random): one of 50 does
        if ghost.haunt(rng, for_s=0) is not None and any(
                name.startswith("ghost-") for name in pending_by_consumer(client)):
            break
    held = {r["message_id"].decode() for r in client.xpending_range(
        KEY, GROUP, min="-", max="+", count=20) if r["consumer"].startswith(b"ghost-")}
    assert held == {blocker}


def test_a_claim_that_moves_nothing_is_not_counted(client: redis.Redis) -> None:
    """The run's ``ghost_never_claimed`` check counts only claims Redis carried out: an entry
    acknowledged between the ghost's look (``XPENDING``) and its ``XCLAIM`` is not a claim."""
    got = client.xreadgroup(GROUP, "owner", {KEY: ">"}, count=2)
    ids = [i.decode() for i, _ in got[0][1]]
    client.xack(KEY, GROUP, *ids)

    class Late:
        """The client, whose ``XPENDING`` still shows the owner's entries just acknowledged."""

        def xpending_range(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
            return [{"message_id": i.encode(), "consumer": b"owner"} for i in ids]

        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

    late = cast(redis.Redis, Late())
    aimed = Ghost(lambda: late, [(KEY, GROUP)], every_s=1, seed=1,
                  blockers=lambda: [(KEY, GROUP, i) for i in ids])
    rng = random.Random(3)
    assert all(aimed.haunt(rng, for_s=0) != GHOST_CLAIM for _ in range(20))
    assert pending_by_consumer(client) == {}  # nothing moved, nothing read

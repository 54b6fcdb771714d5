"""The server's waiting queue: by turns between owners (API keys), first in first out within one."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rag_lookahead.serve.fair_queue import FairQueue

_clock = count()


@dataclass(eq=False)
class Waiting:
    owner: str
    name: str = ""
    submitted: float = field(default_factory=lambda: float(next(_clock)))


def names(jobs) -> list[str]:
    return [j.name for j in jobs]


def test_one_owner_is_first_in_first_out():
    queue = FairQueue()
    for i in range(5):
        queue.append(Waiting("", f"j{i}"))
    assert len(queue) == 5 and names(queue.take(2)) == ["j0", "j1"] and names(queue.take(9)) == ["j2", "j3", "j4"]
    assert not queue and queue.take(1) == []


def test_a_newcomer_takes_turns_and_does_not_jump_ahead_for_long():
    queue = FairQueue()
    for i in range(12):
        queue.append(Waiting("a", f"a{i}"))
    assert names(queue.take(5)) == ["a0", "a1", "a2", "a3", "a4"]  # alone: first in, first out
    for i in range(3):
        queue.append(Waiting("b", f"b{i}"))
    # b joins the end of the round, behind a, and the turns alternate
    assert names(queue.take(6)) == ["a5", "b0", "a6", "b1", "a7", "b2"]
    assert queue.waiting_of("a") == 4 and queue.waiting_of("b") == 0


def test_remove_and_clear():
    queue = FairQueue()
    jobs = [Waiting(o, f"{o}{i}") for i, o in enumerate("abab")]
    for job in jobs:
        queue.append(job)
    queue.remove(jobs[1])  # one of b's two
    assert queue.waiting_of("b") == 1 and len(queue) == 3
    with pytest.raises(ValueError):
        queue.remove(jobs[1])
    queue.remove(jobs[3])
    assert queue.waiting_of("b") == 0
    assert sorted(names(queue.clear())) == ["a0", "a2"] and len(queue) == 0 and list(queue) == []


def test_removing_an_owners_last_job_gives_up_its_turn():
    """A client that left while its only request waited: the next take serves the others (had the
    owner kept its turn, the take would fail with KeyError on it and crash the engine step)."""
    queue = FairQueue()
    a, b = Waiting("a", "a0"), Waiting("b", "b0")
    queue.append(a)
    queue.append(b)
    queue.remove(a)
    assert names(queue.take(2)) == ["b0"] and not queue
    queue.append(a)  # and it can come back, joining the end of the round
    assert names(queue.take(2)) == ["a0"]


@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.none() | st.integers(0, 99)),
        max_size=40,
    )
)
def test_every_job_leaves_once_and_in_order_within_its_owner(ops):
    """Appends interleaved with takes and removes (clients leaving): nothing is lost or taken twice,
    and an owner's jobs leave in the order they came."""
    queue = FairQueue()
    appended: list[Waiting] = []
    taken: list[Waiting] = []
    for i, (owner, take, leave) in enumerate(ops):
        job = Waiting(owner, f"{owner}{i}")
        queue.append(job)
        appended.append(job)
        waiting = list(queue)
        if leave is not None:
            gone = waiting[leave % len(waiting)]
            queue.remove(gone)
            appended.remove(gone)
        taken += queue.take(take)
        assert len(queue) == len(appended) - len(taken)
    taken += queue.take(len(queue))
    assert sorted(map(id, taken)) == sorted(map(id, appended)) and len(taken) == len(appended)
    for owner in "abc":
        assert [j for j in taken if j.owner == owner] == [j for j in appended if j.owner == owner]


def test_owners_waiting_together_alternate():
    queue = FairQueue()
    for i in range(4):
        for owner in "xyz":
            queue.append(Waiting(owner, f"{owner}{i}"))
    order = [j.owner for j in queue.take(12)]
    assert order == list("xyz") * 4


def test_a_keys_second_request_waits_one_round_however_many_keys_come_and_go():
    """Counting admissions, keys sending one request at a time each came in at the least count and
    went ahead of a key's second request for as long as they kept coming (10,000 admissions here)."""
    queue = FairQueue()
    queue.append(Waiting("a", "a1"))
    queue.append(Waiting("a", "a2"))
    for key in ("b", "c", "d"):
        queue.append(Waiting(key, key))
    order = []
    for step in range(20):  # one admission a step, and a new key arrives with one request
        order += names(queue.take(1))
        queue.append(Waiting(f"k{step}", f"k{step}"))
    assert order[:5] == ["a1", "b", "c", "d", "a2"]  # one round of those waiting before it
    assert order[5:8] == ["k0", "k1", "k2"]  # newcomers, in their order of arrival

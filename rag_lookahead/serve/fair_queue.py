"""The engine's waiting queue, fair between API keys.

A plain first-in-first-out queue let one client with many requests (a batch job, a retry loop)
take every batch slot as it came free, while another key's single question waited behind all of
them. Here each owner (an API key's id; "" when the server has no keys) has its own line, and the
owners with requests waiting take turns, one request a turn, round robin: an owner that starts
waiting joins the end of the round, and one that still has requests after its turn goes back to
the end. So a key's next request waits about one round of the keys waiting, however many keys
come and go: counting admissions instead (the key admitted least goes next, a newcomer counted
from the least count waiting) let keys that send one request at a time, each arriving at the
least count, hold a key's second request back for as long as they kept coming (30 s of a 30 s
run, against 0.1 s for theirs). With one owner this is the plain queue.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Protocol

__all__ = ["FairQueue"]


class Owned(Protocol):
    owner: str
    submitted: float


class FairQueue:
    """Waiting jobs by owner; ``take`` hands them out by turns (see the module docstring)."""

    def __init__(self) -> None:
        self._lines: dict[str, collections.deque[Owned]] = {}
        self._turns: collections.deque[str] = collections.deque()  # owners with jobs waiting, next first
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Owned]:
        for line in list(self._lines.values()):
            yield from list(line)

    def waiting_of(self, owner: str) -> int:
        line = self._lines.get(owner)
        return len(line) if line else 0

    def append(self, job: Owned) -> None:
        line = self._lines.get(job.owner)
        if line is None:
            line = self._lines[job.owner] = collections.deque()
            self._turns.append(job.owner)
        line.append(job)
        self._size += 1

    def remove(self, job: Owned) -> None:
        """Drop ``job`` (ValueError when it is not waiting)."""
        line = self._lines.get(job.owner)
        if line is None:
            raise ValueError("not waiting")
        line.remove(job)
        self._size -= 1
        if not line:
            del self._lines[job.owner]
            self._turns.remove(job.owner)

    def take(self, count: int) -> list[Owned]:
        """Up to ``count`` jobs, one at a time by turns."""
        taken = []
        while self._size and len(taken) < count:
            owner = self._turns.popleft()
            line = self._lines[owner]
            taken.append(line.popleft())
            self._size -= 1
            if line:
                self._turns.append(owner)
            else:
                del self._lines[owner]
        return taken

    def clear(self) -> list[Owned]:
        """Empty the queue; returns what was waiting."""
        jobs = list(self)
        self._lines.clear()
        self._turns.clear()
        self._size = 0
        return jobs

"""The engine's waiting queue, fair between API keys.

A plain first-in-first-out queue let one client with many requests (a batch job, a retry loop)
take every batch slot as it came free, while another key's single question waited behind all of
them. Here each owner (an API key's id; "" when the server has no keys) has its own line, and a
free slot goes to the owner admitted least so far among those waiting, the oldest request first
between equals. An owner that starts waiting is counted from the least count of those already
waiting, not from zero, so a newcomer takes turns with the others instead of jumping ahead of
them for as many admissions as they had before it came. With one owner this is the plain queue.
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
        self._admitted: dict[str, int] = {}  # owners with jobs waiting: admissions counted
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
            self._admitted[job.owner] = min(self._admitted.values(), default=0)
            line = self._lines[job.owner] = collections.deque()
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
            self._forget(job.owner)

    def take(self, count: int) -> list[Owned]:
        """Up to ``count`` jobs, one at a time by turns."""
        taken = []
        while self._size and len(taken) < count:
            owner = min(self._lines, key=lambda o: (self._admitted[o], self._lines[o][0].submitted))
            line = self._lines[owner]
            taken.append(line.popleft())
            self._size -= 1
            self._admitted[owner] += 1
            if not line:
                self._forget(owner)
        return taken

    def clear(self) -> list[Owned]:
        """Empty the queue; returns what was waiting."""
        jobs = list(self)
        self._lines.clear()
        self._admitted.clear()
        self._size = 0
        return jobs

    def _forget(self, owner: str) -> None:
        del self._lines[owner]
        del self._admitted[owner]

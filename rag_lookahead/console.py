"""The ``rag_lookahead`` console script (and ``python -m rag_lookahead``)."""

from __future__ import annotations

from rag_lookahead.interrupts import command_interrupts


def main() -> None:
    with command_interrupts(own_process=True) as imported:  # the commands import torch first
        from rag_lookahead.cli import app

        imported()
        app(prog_name="rag_lookahead")

"""The ``rag_lookahead`` console script (and ``python -m rag_lookahead``)."""

from __future__ import annotations

from rag_lookahead.interrupts import quiet_while_importing


def main() -> None:
    with quiet_while_importing():  # the commands import torch first
        from rag_lookahead.cli import app
    app(prog_name="rag_lookahead")

"""``python -m rag_lookahead.serve``: the OpenAI-compatible server (same as ``rag_lookahead serve``)."""

from rag_lookahead.interrupts import quiet_while_importing

with quiet_while_importing():
    from rag_lookahead.serve.command import main

raise SystemExit(main())

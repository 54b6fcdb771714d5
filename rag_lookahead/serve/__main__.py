"""``python -m rag_lookahead.serve``: the OpenAI-compatible server (same as ``rag_lookahead serve``)."""

from rag_lookahead.interrupts import command_interrupts

with command_interrupts(own_process=True) as imported:
    from rag_lookahead.serve.command import main

    imported()
    code = main()
raise SystemExit(code)

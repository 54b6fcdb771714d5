"""``python -m rag_lookahead <command>``: the same commands as the ``rag_lookahead`` console script,
for environments where the script's folder is not on PATH (a venv not activated, ``pip install --user``)."""

from __future__ import annotations

from rag_lookahead.console import main

if __name__ == "__main__":
    main()

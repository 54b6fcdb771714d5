"""``python -m rag_lookahead.bench``: the batch-1 side-by-side benchmark (see :mod:`.single`)."""

from rag_lookahead.bench.single import main

main()

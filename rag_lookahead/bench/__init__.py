"""The benchmarks (one module each; see the README's benchmark sections).

Run as a program (``python -m rag_lookahead.bench.retrieval``), a module's package is imported
before the module's own imports of torch and transformers: from here a Ctrl-C exits 130 quietly,
also during those imports (a traceback through ``import torch`` and death by SIGINT before).
"""

import sys

if sys.argv[:1] == ["-m"]:  # runpy imports the package while argv[0] is still "-m"
    from rag_lookahead.interrupts import program_importing

    program_importing()

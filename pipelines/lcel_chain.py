"""The LCEL RAG chain: question -> {"answer", "sources", "stats"}, streamed token by token.

    python pipelines/lcel_chain.py "How should I set decoding_length on a CPU?" [--index-dir DIR] [--no-lookahead]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from langchain_core.callbacks import BaseCallbackHandler

from rag_lookahead.ask import ensure_index
from rag_lookahead.chains import build_rag_chain
from rag_lookahead.index import default_index_dir
from rag_lookahead.llm import LookaheadLLM


class PrintTokens(BaseCallbackHandler):
    def on_llm_new_token(self, token: str, **kwargs) -> None:
        sys.stdout.write(token)
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question")
    ap.add_argument("--index-dir", type=Path, default=None)
    ap.add_argument("--model", default="default")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--k-seed", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--no-lookahead", action="store_true")
    args = ap.parse_args()

    index = ensure_index(args.index_dir or default_index_dir())
    llm = LookaheadLLM.from_model_id(args.model, max_new_tokens=args.max_new_tokens)
    chain = build_rag_chain(llm, index, k_prompt=args.k, k_seed=args.k_seed)
    out = chain.invoke(
        {"question": args.question, "enable_lookahead": not args.no_lookahead},
        config={"callbacks": [PrintTokens()]},
    )
    print("\n")
    for s in out["sources"]:
        print(f"- {s['source']}{'' if s['in_prompt'] else ' (seed only)'}: {s['snippet'][:100]}")
    print(json.dumps(out["stats"], ensure_ascii=False))


if __name__ == "__main__":
    main()

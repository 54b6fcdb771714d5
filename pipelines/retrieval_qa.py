"""RetrievalQA (langchain_classic) with LookaheadLLM; extra retrieved passages seed the draft trie.

    python pipelines/retrieval_qa.py "decoding_length 应该怎么设置？" [--index-dir DIR] [--k 3] [--k-seed 8]

Builds the index from the bundled corpora/ on first use (see rag_lookahead.ask.ensure_index).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rag_lookahead.ask import ensure_index
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.rag.chains import build_retrieval_qa
from rag_lookahead.rag.index import default_index_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question")
    ap.add_argument("--index-dir", type=Path, default=None)
    ap.add_argument("--model", default="default")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--k-seed", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()

    index = ensure_index(args.index_dir or default_index_dir())
    llm = LookaheadLLM.from_model_id(args.model, max_new_tokens=args.max_new_tokens)
    qa = build_retrieval_qa(llm, index, k_prompt=args.k, k_seed=args.k_seed)
    # the same, spelled out:
    #   RetrievalQA.from_chain_type(llm=llm, retriever=SeedingRetriever(retriever=index.as_retriever(k=8),
    #       llm=llm, k_prompt=3, k_seed=8), chain_type_kwargs={"prompt": RAG_PROMPT}, return_source_documents=True)
    out = qa.invoke({"query": args.question})
    print(out["result"].strip())
    print()
    for doc in out["source_documents"]:
        print(f"- {doc.metadata.get('source')}: {' '.join(doc.page_content.split())[:100]}")


if __name__ == "__main__":
    main()

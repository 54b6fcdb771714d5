"""RetrievalQA (langchain_classic) with LookaheadLLM; extra retrieved passages seed the draft trie.

    python pipelines/retrieval_qa.py "decoding_length 应该怎么设置？" [--index-dir DIR] [--k 3] [--k-seed 8]

Builds the index from the bundled corpora/ on first use (see pipelines/rag_args.py).
"""

from __future__ import annotations

from rag_args import open_index, rag_parser, run

from rag_lookahead.errors import one_line
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.rag.chains import build_retrieval_qa


def main() -> None:
    ap = rag_parser(__doc__.splitlines()[0])
    ap.add_argument("question")
    ap.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=256)
    args = ap.parse_args()

    index = open_index(args)
    llm = LookaheadLLM.from_model_id(args.model, max_new_tokens=args.max_new_tokens)
    qa = build_retrieval_qa(llm, index, k_prompt=args.k, k_seed=args.k_seed)
    # the same, spelled out (the document prompt heads each passage as `ask`'s prompt does):
    #   RetrievalQA.from_chain_type(llm=llm, retriever=SeedingRetriever(retriever=index.as_retriever(k=8),
    #       llm=llm, k_prompt=3, k_seed=8), chain_type_kwargs={"prompt": RAG_PROMPT, "document_prompt":
    #       PromptTemplate.from_template("{context_label}\n{page_content}")}, return_source_documents=True)
    out = qa.invoke({"query": args.question.strip()})
    print(out["result"].strip())
    print()
    for doc in out["source_documents"]:
        # a file name's control characters as escapes: a name may hold ESC or a line break
        print(f"- {one_line(str(doc.metadata.get('source')))}: {one_line(' '.join(doc.page_content.split())[:100])}")


if __name__ == "__main__":
    run(main)

"""A RAG chain in current LangChain style: LCEL with a ChatPromptTemplate and the ChatLookahead chat model.

    python pipelines/lcel_chain.py "What does the budget option do?" [--index-dir DIR] [--no-lookahead]

The chain is the one from LangChain's RAG tutorial, with our retriever and chat model swapped in:

    {"context": retriever | format_context, "question": RunnablePassthrough()} | prompt | chat | StrOutputParser()

``build_chat_rag_chain`` (see pipelines/chat_stream.py) is the same chain plus sources, stats and
the retrieved passages that did not fit the prompt handed to the drafter as seeds.
Builds the index from the bundled corpora/ on first use (see pipelines/rag_args.py).
"""

from __future__ import annotations

from rag_args import open_index, rag_parser, run

from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import RunnablePassthrough

from rag_lookahead.langchain.chat_model import ChatLookahead
from rag_lookahead.rag.chains import RAG_CHAT_PROMPT, as_retriever, format_context


def main() -> None:
    ap = rag_parser(__doc__.splitlines()[0], k_seed=False)
    ap.add_argument("question")
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=256)
    ap.add_argument("--no-lookahead", action="store_true")
    args = ap.parse_args()

    retriever = as_retriever(open_index(args), args.k)
    chat = ChatLookahead(model=args.model, max_tokens=args.max_tokens)
    chain = (
        {"context": retriever | format_context, "question": RunnablePassthrough()}
        | RAG_CHAT_PROMPT
        | chat.bind(enable_lookahead=not args.no_lookahead)
        | StrOutputParser()
    )
    for piece in chain.stream(args.question.strip()):  # one piece per block of accepted tokens
        print(piece, end="", flush=True)
    print()


if __name__ == "__main__":
    run(main)

"""Streaming chat over the bundled user guide: sources first, then the answer as it is decoded.

    python pipelines/chat_stream.py "What does the budget option do?" "branch_length 的默认值是多少？"

Each question goes through ``build_chat_rag_chain`` (retriever -> ChatPromptTemplate -> ChatLookahead):
its ``.stream()`` yields ``{"sources": [...]}`` before the model starts, then ``{"answer": piece}``
for each block of tokens the decoder accepts, then ``{"stats": {...}}``. Passages retrieved beyond
the prompt's ``--k`` seed the draft trie (``--k-seed``), which changes the speed, never the text.
Builds the index from the bundled corpora/ on first use.
"""

from __future__ import annotations

from rag_args import open_index, rag_parser, run

from rag_lookahead.errors import one_line
from rag_lookahead.langchain.chat_model import ChatLookahead
from rag_lookahead.rag.chains import build_chat_rag_chain

QUESTIONS = ["What does the budget option do?", "branch_length 的默认值是多少？"]


def show(chain, question: str) -> None:
    print(f"\n>>> {question}")
    stats: dict = {}
    for part in chain.stream(question):
        if "sources" in part:
            for s in part["sources"]:
                where = "prompt" if s["in_prompt"] else "seed only"
                print(f"  [{where}] {one_line(s['source'])}: {one_line(s['snippet'][:80])}")  # ESC, breaks escaped
            print()
        if "answer" in part:
            print(part["answer"], end="", flush=True)
        stats.update(part.get("stats", {}))
    usage = stats.get("usage", {})
    print(
        f"\n[{usage.get('output_tokens', 0)} tokens, {stats.get('tokens_per_second', 0):.1f} tok/s, "
        f"{stats.get('mean_accepted', 0):.2f} accepted per step, finish: {stats.get('finish_reason')}]"
    )


def main() -> None:
    ap = rag_parser(__doc__.splitlines()[0])
    ap.add_argument("questions", nargs="*", default=QUESTIONS)
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=256)
    ap.add_argument("--no-lookahead", action="store_true")
    args = ap.parse_args()

    index = open_index(args)
    chat = ChatLookahead(model=args.model, max_tokens=args.max_tokens)
    model = chat.bind(enable_lookahead=False) if args.no_lookahead else chat  # per-call options go through bind
    chain = build_chat_rag_chain(model, index, k_prompt=args.k, k_seed=args.k_seed)
    for question in args.questions:
        show(chain, question)


if __name__ == "__main__":
    run(main)

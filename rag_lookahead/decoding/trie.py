"""N-gram tries that the drafter reads continuations from.

Two pools feed the drafter:

* ``ContextPool`` (one per request): the prompt, the request's reference passages and the
  tokens generated so far. Every position starts a window of ``depth`` tokens, so a lookup
  keyed on the last few tokens finds every earlier place where they occurred, with what
  followed. Tokens stream in with ``extend``; each token costs O(depth).
* ``OutputPool`` (shared by all requests of a model): n-grams of earlier answers, so that a
  follow-up question over the same documents drafts from what was already said. Memory is
  bounded: past ``max_nodes`` every count is halved and nodes that reach zero are dropped,
  which keeps frequent n-grams and forgets rare old ones. A lock makes it safe to share.

Pure Python, no torch: the drafter runs between forwards and must stay cheap.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence


class Node:
    """One token of an n-gram; ``count`` is how often the path from the root to it occurred."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


class NGramTrie:
    """Counts every n-gram of at most ``depth`` tokens of the sequences inserted into it."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError("trie depth must be >= 2")
        self.depth = depth
        self.root = Node()
        self.nodes = 0

    def _child(self, node: Node, token: int) -> Node:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = Node()
            self.nodes += 1
        child.count += 1
        return child

    def insert(self, tokens: Sequence[int]) -> None:
        """Add all windows of one independent sequence (n-grams never cross sequences)."""
        tokens = list(tokens)
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                node = self._child(node, token)

    def find(self, key: Sequence[int]) -> Node | None:
        """The node reached by walking ``key`` from the root, or None."""
        node = self.root
        for token in key:
            node = node.children.get(token)
            if node is None:
                return None
        return node


class ContextPool(NGramTrie):
    """The per-request pool: reference sequences plus one growing stream (prompt + answer)."""

    def __init__(self, depth: int, references: Iterable[Sequence[int]] = ()) -> None:
        super().__init__(depth)
        for reference in references:
            self.insert(reference)
        self.stream: list[int] = []
        self._open: list[tuple[Node, int]] = []  # windows of the stream still growing: (node, length)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the stream, inserting each window that they extend."""
        depth = self.depth
        for token in tokens:
            self.stream.append(token)
            grown = [(self._child(node, token), length + 1) for node, length in self._open if length < depth]
            grown.append((self._child(self.root, token), 1))
            self._open = grown


class OutputPool:
    """N-grams of earlier answers, shared across requests, bounded in memory, thread-safe."""

    def __init__(self, depth: int, max_nodes: int = 2_000_000) -> None:
        self.trie = NGramTrie(depth)
        self.max_nodes = max_nodes
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OutputPool(depth={self.depth}, nodes={self.nodes:,}, max_nodes={self.max_nodes:,})"

    @property
    def depth(self) -> int:
        return self.trie.depth

    @property
    def nodes(self) -> int:
        return self.trie.nodes

    def add(self, tokens: Sequence[int]) -> None:
        """Insert one finished answer; decay the pool if it grew past its bound."""
        with self.lock:
            self.trie.insert(tokens)
            while self.trie.nodes > self.max_nodes:
                self._decay()

    def _decay(self) -> None:
        """Halve every count and drop the nodes that reach zero."""
        removed = 0
        stack = [self.trie.root]
        while stack:
            node = stack.pop()
            for token, child in list(node.children.items()):
                child.count //= 2
                if child.count == 0:
                    removed += _subtree_size(child)
                    del node.children[token]
                else:
                    stack.append(child)
        self.trie.nodes -= removed
        if removed == 0:  # every count >= 2 everywhere cannot persist, but never loop forever
            self.trie.root.children.clear()
            self.trie.nodes = 0


def _subtree_size(node: Node) -> int:
    size, stack = 0, [node]
    while stack:
        current = stack.pop()
        size += 1
        stack.extend(current.children.values())
    return size

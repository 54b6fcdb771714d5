"""N-gram tries that the drafter reads continuations from.

Two pools feed the drafter:

* ``ContextPool`` (one per request): the prompt, the request's reference passages and the
  tokens generated so far. Every position starts a window of ``depth`` tokens, so a lookup
  keyed on the last few tokens finds every earlier place where they occurred, with what
  followed. Tokens stream in with ``extend``; each token costs O(depth).
* ``OutputPool`` (shared by all requests of a model): n-grams of earlier answers, so that a
  follow-up question over the same documents drafts from what was already said. Memory is
  bounded: past ``max_nodes`` every count is halved (as often as it takes to come down to
  ``OutputPool.LOW_WATER`` of it) and nodes that reach zero are dropped, which keeps frequent
  n-grams and forgets rare old ones. A lock makes it safe to share.

Pure Python, no torch: the drafter runs between forwards and must stay cheap.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Sequence

#: a child is found by ``node * _SPAN + token`` in one dict (token ids are below 2**32)
_SPAN = 1 << 32


class NGramTrie:
    """Counts every n-gram of at most ``depth`` tokens of the sequences inserted into it.

    Nodes are ints (``ROOT`` is 0): their counts, tokens and child lists live in flat arrays,
    and the edges in one dict of ints. Why not an object per node: CPython's garbage collector
    tracks every object that can hold references, and its full collections walk them all. Tries
    of 64 rows' prompts (~1.7M objects) made one full collection pause a 64-row step by ~1 s
    (40 ms a step on average over 24 steps, bf16, 2-core Xeon); arrays and a dict of ints are
    not tracked at all, and they take about a third of the memory.
    """

    ROOT = 0

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError("trie depth must be >= 2")
        self.depth = depth
        self._edges: dict[int, int] = {}  # node * _SPAN + token -> child
        self._counts = array("q", [0])  # how often the path from the root to the node occurred
        self._tokens = array("q", [-1])  # the token on the edge into the node
        self._first = array("q", [-1])  # first child (-1: none), then in order of creation ...
        self._last = array("q", [-1])
        self._sibling = array("q", [-1])  # ... through each child's next sibling

    @property
    def nodes(self) -> int:
        return len(self._counts) - 1

    def count(self, node: int) -> int:
        return self._counts[node]

    def has_children(self, node: int) -> bool:
        return self._first[node] >= 0

    def children(self, node: int) -> list[tuple[int, int]]:
        """``(token, child)`` of each child of ``node``, oldest first."""
        found, child = [], self._first[node]
        while child >= 0:
            found.append((self._tokens[child], child))
            child = self._sibling[child]
        return found

    def _new_child(self, node: int, token: int, key: int, count: int) -> int:
        """Make ``node``'s child on ``token`` (``key``: its edge), last among its siblings."""
        first, last, sibling = self._first, self._last, self._sibling
        child = self._edges[key] = len(self._counts)
        self._counts.append(count)
        self._tokens.append(token)
        first.append(-1)
        last.append(-1)
        sibling.append(-1)
        if last[node] >= 0:
            sibling[last[node]] = child
        else:
            first[node] = child
        last[node] = child
        return child

    def insert(self, tokens: Sequence[int]) -> None:
        """Add all windows of one independent sequence (n-grams never cross sequences)."""
        self._grow([], tokens)

    def cut_back(self, nodes: int) -> None:
        """Drop every node made after the first ``nodes`` and relink the rest: an insert stopped
        part way (a Ctrl-C) leaves the edges and the node arrays out of step, and every later
        lookup through them failed. Counts it raised on older nodes stay (they steer drafts only)."""
        keep = nodes + 1
        for column in (self._counts, self._tokens, self._first, self._last, self._sibling):
            del column[keep:]
        self._edges = {key: child for key, child in self._edges.items() if child < keep}
        first, last, sibling = self._first, self._last, self._sibling
        for node in range(keep):
            if first[node] >= keep:
                first[node] = -1
            if sibling[node] >= keep:
                sibling[node] = -1
        for node in range(keep):
            if last[node] >= keep or (last[node] < 0) != (first[node] < 0):
                child, end = first[node], -1
                while child >= 0:
                    child, end = sibling[child], child
                last[node] = end

    def _grow(self, windows: list[int], tokens: Iterable[int]) -> None:
        """Extend every open window by each token in turn, starting a new window at each token.

        ``windows``: the last node of each window still growing, longest first (the i-th holds
        ``len(windows) - i`` tokens); updated in place. Token by token rather than window by
        window, with the edge lookup written out: seeding a prompt makes ~``depth`` nodes a token,
        and on a GPU that host work takes about as long as the prefill forward itself (1,000
        prompt tokens, depth 52: ~50k nodes, 32.5 ms against 38.7 ms window by window through
        a method call a node, medians of 12 here). Each node's children still come in the order
        of their n-grams' first occurrence, so drafts are the same."""
        depth, edges, counts, new_child = self.depth, self._edges, self._counts, self._new_child
        for token in tokens:
            if len(windows) == depth:  # the longest window is full: it stops growing
                del windows[0]
            windows.append(self.ROOT)  # a window starts at this token
            for i, node in enumerate(windows):
                key = node * _SPAN + token
                child = edges.get(key)
                if child is None:
                    child = new_child(node, token, key, 1)
                else:
                    counts[child] += 1
                windows[i] = child

    def decayed(self, halvings: int = 1) -> NGramTrie:
        """A copy with every count halved ``halvings`` times and the nodes whose count reaches
        zero dropped.

        With arrays, not a walk: a Python walk over a full pool (2M nodes, most kept) took 6-9 s
        on the engine thread, and every request waited. A child's count never exceeds its
        parent's (each window that reaches the child passed the parent), so the kept nodes form
        a tree; they keep their order, hence each node's children stay oldest first."""
        import numpy as np

        halved = np.frombuffer(self._counts, dtype=np.int64) >> halvings
        keep = halved > 0
        keep[self.ROOT] = True
        new_id = np.cumsum(keep) - 1
        kept = NGramTrie(self.depth)
        edges = len(self._edges)
        keys = np.fromiter(self._edges.keys(), dtype=np.int64, count=edges)
        children = np.fromiter(self._edges.values(), dtype=np.int64, count=edges)
        live = keep[children]
        keys, children = keys[live], new_id[children[live]]
        parents = new_id[keys // _SPAN]
        kept._edges = dict(zip((parents * _SPAN + keys % _SPAN).tolist(), children.tolist()))
        size = int(new_id[-1]) + 1
        first, last, sibling = (np.full(size, -1, dtype=np.int64) for _ in range(3))
        by_parent = np.lexsort((children, parents))  # then oldest first
        order, grouped = children[by_parent], parents[by_parent]
        same = grouped[1:] == grouped[:-1]
        sibling[order[:-1][same]] = order[1:][same]
        if len(order):
            starts, ends = np.flatnonzero(np.r_[True, ~same]), np.flatnonzero(np.r_[~same, True])
            first[grouped[starts]] = order[starts]
            last[grouped[ends]] = order[ends]
        tokens = np.frombuffer(self._tokens, dtype=np.int64)[keep]
        for name, column in (
            ("_counts", halved[keep]),
            ("_tokens", tokens),
            ("_first", first),
            ("_last", last),
            ("_sibling", sibling),
        ):
            setattr(kept, name, array("q", column.astype(np.int64).tobytes()))
        return kept

    def find(self, key: Sequence[int]) -> int | None:
        """The node reached by walking ``key`` from the root, or None."""
        node = self.ROOT
        edges = self._edges
        for token in key:
            node = edges.get(node * _SPAN + token)
            if node is None:
                return None
        return node


class _Occurrences:
    """A context-pool node: an n-gram of ``length`` tokens, by the positions where its
    occurrences end (ascending); its children are worked out once, when first asked for."""

    __slots__ = ("length", "ends", "_children")

    def __init__(self, length: int, ends: list[int]) -> None:
        self.length = length
        self.ends = ends
        self._children: list[tuple[int, _Occurrences]] | None = None


class ContextPool:
    """The per-request pool: reference sequences plus one growing stream (prompt + answer).

    It answers the trie's questions (``find``, ``children``, ``count``, ``has_children``) with
    the same nodes, counts and children's order as an ``NGramTrie`` of the same sequences, but it
    stores only the text and, for every n-gram of up to ``key_length`` tokens, where it occurs.
    Why: a trie makes ~``depth`` nodes a token (50 here), so seeding a 1,000-token prompt cost
    ~30 ms of host time before the first token, about a GPU's whole prefill, and ~7 KB a token
    of memory per row. Here a token costs ``key_length`` dict and array updates; a node's
    children are found when a draft reads them, by grouping the tokens that follow its
    occurrences, oldest occurrence first (the order in which the trie would have made them).
    The keys a draft starts from are at most ``key_length`` tokens; longer ones are walked. A key
    with more than ``MOST_OCCURRENCES`` occurrences is read from its latest ones only. Integers
    and arrays only, so the garbage collector has nothing to walk (see ``NGramTrie``).
    """

    _GAP = -1  # between sequences in ``_text``: n-grams never cross it
    #: a key's latest occurrences a draft reads: where one key occurs thousands of times (a long run of
    #: one token, an answer caught in a loop), a draft would group them all at every level it grows;
    #: a trie counts them all. Drafts differ from a trie's only past this (never their tokens' exactness).
    MOST_OCCURRENCES = 256

    def __init__(self, depth: int, references: Iterable[Sequence[int]] = (), key_length: int = 4) -> None:
        if depth < 2:
            raise ValueError("trie depth must be >= 2")
        if key_length < 1:
            raise ValueError("key_length must be >= 1")
        self.depth = depth
        self.key_length = min(key_length, depth)
        self.ROOT = _Occurrences(0, [])  # its children: every token's occurrences (for tests and debugging)
        self._text = array("q")  # every sequence, a gap after each reference
        # per n-gram length n (index n - 1): n-gram -> where it last ended (its first occurrence
        # sets its place in the dict's order); per position, where the n-gram ending there ended before
        self._last: list[dict[int, int]] = [{} for _ in range(self.key_length)]
        self._previous = [array("q") for _ in range(self.key_length)]
        self._suffixes: list[int] = []  # the n-grams ending at the last position, shortest first
        for reference in references:
            self._append(reference)
            self._append_gap()
        self.stream: list[int] = []

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the stream."""
        tokens = list(tokens)
        self.stream.extend(tokens)
        self._append(tokens)

    def _append(self, tokens: Iterable[int]) -> None:
        text, lasts, previous, most = self._text, self._last, self._previous, self.key_length - 1
        suffixes = self._suffixes
        for token in tokens:
            end = len(text)
            text.append(token)
            suffixes = [token] + [key * _SPAN + token for key in suffixes[:most]]
            for n, key in enumerate(suffixes):
                last = lasts[n]
                previous[n].append(last.get(key, -1))
                last[key] = end
            for n in range(len(suffixes), self.key_length):
                previous[n].append(-1)
        self._suffixes = suffixes

    def _append_gap(self) -> None:
        self._text.append(self._GAP)
        for n in range(self.key_length):
            self._previous[n].append(-1)
        self._suffixes = []

    def _indexed(self, key: Sequence[int]) -> _Occurrences | None:
        """The node of ``key`` (at most ``key_length`` tokens) from the index."""
        code = 0
        for token in key:
            code = code * _SPAN + token
        n = len(key) - 1
        end = self._last[n].get(code)
        if end is None:
            return None
        ends, before = [], self._previous[n]
        while end >= 0 and len(ends) < self.MOST_OCCURRENCES:
            ends.append(end)
            end = before[end]
        ends.reverse()
        return _Occurrences(len(key), ends)

    def find(self, key: Sequence[int]) -> _Occurrences | None:
        """The node of ``key`` (its occurrences), or None: as ``NGramTrie.find``."""
        if not key:
            return self.ROOT
        if len(key) > self.depth:
            return None
        node = self._indexed(key[: self.key_length])
        for token in key[self.key_length :]:
            if node is None:
                return None
            node = next((child for t, child in self.children(node) if t == token), None)
        return node

    def count(self, node: _Occurrences) -> int:
        return len(node.ends)

    def has_children(self, node: _Occurrences) -> bool:
        return bool(self.children(node))

    def children(self, node: _Occurrences) -> list[tuple[int, _Occurrences]]:
        """``(token, child)`` of each token that followed ``node``'s n-gram, by first occurrence."""
        if node is self.ROOT:  # never kept: the stream grows
            return [(token, self._indexed([token])) for token in self._last[0]]
        if node._children is None:
            node._children = self._children_of(node)
        return node._children

    def _children_of(self, node: _Occurrences) -> list[tuple[int, _Occurrences]]:
        if node.length >= self.depth:
            return []
        text, gap, size = self._text, self._GAP, len(self._text)
        groups: dict[int, list[int]] = {}
        for end in node.ends:
            following = end + 1
            if following < size:
                token = text[following]
                if token != gap:
                    group = groups.get(token)
                    if group is None:
                        groups[token] = [following]
                    else:
                        group.append(following)
        length = node.length + 1
        return [(token, _Occurrences(length, ends)) for token, ends in groups.items()]


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
            before = self.trie.nodes
            try:
                self.trie.insert(tokens)
            except BaseException:  # a KeyboardInterrupt part way: the pool outlives this request
                self.trie.cut_back(before)
                raise
            if self.trie.nodes > self.max_nodes:
                self._decay()

    #: a trim brings the pool down to this share of ``max_nodes``: trimmed only just under the cap,
    #: a pool of answers asked again and again (counts of 2 and more survive a halving) was over
    #: it again a few dozen answers later, and trimmed again
    LOW_WATER = 0.75

    def _decay(self) -> None:
        """Halve every count as many times as it takes to keep at most ``LOW_WATER`` of
        ``max_nodes``, and drop the nodes that reach zero (the trie is copied without them): one
        copy, however many halvings."""
        import numpy as np

        counts = np.frombuffer(self.trie._counts, dtype=np.int64)
        target = int(self.max_nodes * self.LOW_WATER)
        halvings = 1
        try:
            while np.count_nonzero(counts >= (1 << halvings)) > target:
                halvings += 1
        finally:  # the array cannot grow while a view of it lives (a traceback kept after a Ctrl-C too)
            del counts
        self.trie = self.trie.decayed(halvings)

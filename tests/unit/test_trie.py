"""The n-gram pools and the draft trees built from them (pure Python, no model)."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from rag_lookahead import LookaheadConfig
from rag_lookahead.decoding.draft import DraftTree, _TreeBuilder, children_of, propose
from rag_lookahead.decoding.trie import _SPAN, ContextPool, NGramTrie, OutputPool

sequences = st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=60)


def _ngram_counts(tokens, depth):
    counts = {}
    for start in range(len(tokens)):
        for end in range(start + 1, min(start + depth, len(tokens)) + 1):
            key = tuple(tokens[start:end])
            counts[key] = counts.get(key, 0) + 1
    return counts


def _trie_counts(trie):
    counts, stack = {}, [((), trie.ROOT)]
    while stack:
        path, node = stack.pop()
        for token, child in trie.children(node):
            counts[path + (token,)] = trie.count(child)
            stack.append((path + (token,), child))
    return counts


@settings(max_examples=200, deadline=None)
@given(tokens=sequences, depth=st.integers(min_value=2, max_value=6), split=st.integers(min_value=0, max_value=60))
def test_streamed_context_counts_every_ngram_once(tokens, depth, split):
    pool = ContextPool(depth)
    pool.extend(tokens[:split])  # tokens arrive in two blocks, as prompt then answer
    pool.extend(tokens[split:])
    assert _trie_counts(pool) == _ngram_counts(tokens, depth)
    assert pool.stream == tokens


def _shape(trie, node=None):
    """The trie below ``node`` (default: the root) as nested ``(token, count, children)``, in its order."""
    node = trie.ROOT if node is None else node
    return [(token, trie.count(child), _shape(trie, child)) for token, child in trie.children(node)]


def _child(trie, node, token):
    """The child of ``node`` on ``token``, made if new; its count raised by one."""
    key = node * _SPAN + token
    child = trie._edges.get(key)
    if child is None:
        return trie._new_child(node, token, key, 1)
    trie._counts[child] += 1
    return child


def _window_by_window(depth, sequences):
    """The trie as ``insert`` built it before streaming: each window walked whole, one after another."""
    trie = NGramTrie(depth)
    for tokens in sequences:
        for start in range(len(tokens)):
            node = trie.ROOT
            for token in tokens[start : start + depth]:
                node = _child(trie, node, token)
    return trie


@settings(max_examples=200, deadline=None)
@given(
    tokens=sequences,
    references=st.lists(sequences, max_size=2),
    depth=st.integers(min_value=2, max_value=6),
    split=st.integers(min_value=0, max_value=60),
)
def test_streaming_builds_the_trie_window_by_window_insertion_does(tokens, references, depth, split):
    """``extend`` and ``insert`` grow all windows token by token, with the edge lookup written out
    for speed; every node's count and its children's order (drafts read children oldest first)
    must be what walking each window whole gives."""
    pool = ContextPool(depth, references)
    pool.extend(tokens[:split])
    pool.extend(tokens[split:])
    assert _shape(pool) == _shape(_window_by_window(depth, [*references, tokens]))
    trie = NGramTrie(depth)
    for sequence in references:
        trie.insert(sequence)
    assert _shape(trie) == _shape(_window_by_window(depth, references))


def test_the_context_pool_stores_a_few_entries_a_token_not_depth_nodes():
    """A trie made ``depth`` nodes a token (~7 KB a token at depth 52); the pool keeps the text and
    ``key_length`` index entries a token, whatever the depth."""
    import tracemalloc

    tokens = list(range(5000))  # all distinct: every n-gram is new
    tracemalloc.start()
    pool = ContextPool(depth=52, key_length=4)
    pool.extend(tokens)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(len(last) for last in pool._last) == 4 * len(tokens) - 6
    assert size / len(tokens) < 1200  # bytes a token: text, stream, four n-grams with their first/last ends


def test_references_do_not_join_across_sequences():
    trie = NGramTrie(depth=3)
    trie.insert([1, 2])
    trie.insert([3, 4])
    assert trie.find([2, 3]) is None
    assert trie.count(trie.find([1, 2])) == 1


def test_output_pool_stays_bounded_and_keeps_frequent_ngrams():
    pool = OutputPool(depth=4, max_nodes=200)
    frequent = [7, 8, 9, 10]
    for i in range(300):
        pool.add(frequent)
        pool.add([100 + i, 200 + i, 300 + i])  # rare n-grams, each seen once
        assert pool.nodes <= 200
    assert pool.trie.find(frequent) is not None
    assert pool.trie.find([100, 200]) is None  # an old rare n-gram was forgotten


def test_a_trim_leaves_room_for_many_answers_when_answers_are_asked_again():
    """A pool of answers asked again and again (counts of 2 and more survive a halving) was trimmed
    only just under its cap, so a few answers later it was over it and trimmed again (on a full
    server pool, a 6-9 s stall of every request each time): one trim now comes down to
    ``LOW_WATER`` of the cap, halving as often as that takes, and keeps the most frequent."""
    import random

    rng = random.Random(0)
    pool = OutputPool(depth=4, max_nodes=2000)
    popular = [[rng.randrange(1000) for _ in range(12)] for _ in range(40)]
    for answer in popular * 4:
        pool.add(answer)
    trims = 0
    for i in range(400):
        before = pool.nodes
        pool.add([rng.randrange(1000) for _ in range(12)] if i % 2 else popular[i % 40])
        if pool.nodes < before:
            trims += 1
            assert pool.nodes <= OutputPool.LOW_WATER * pool.max_nodes
        assert pool.nodes <= pool.max_nodes
    assert 1 <= trims <= 12
    assert pool.trie.find(popular[0][:4]) is not None  # asked most: kept


def test_decay_halves_counts_and_keeps_children_in_order():
    pool = OutputPool(depth=3, max_nodes=10**6)
    for _ in range(4):
        pool.add([1, 2, 3])
    pool.add([1, 5])
    pool.add([1, 4])
    pool._decay()
    trie = pool.trie
    assert _trie_counts(trie) == {(1,): 3, (1, 2): 2, (1, 2, 3): 2, (2,): 2, (2, 3): 2, (3,): 2}
    assert [token for token, _ in trie.children(trie.find([1]))] == [2]
    assert pool.nodes == 6


def _children_orders(trie):
    """Every node's children's tokens, oldest first, by the node's path."""
    orders, stack = {}, [((), trie.ROOT)]
    while stack:
        path, node = stack.pop()
        orders[path] = [token for token, _ in trie.children(node)]
        stack.extend((path + (token,), child) for token, child in trie.children(node))
    return orders


@settings(max_examples=150, deadline=None)
@given(
    answers=st.lists(st.lists(st.integers(min_value=0, max_value=6), max_size=12), max_size=12),
    depth=st.integers(min_value=2, max_value=5),
    halvings=st.integers(min_value=1, max_value=3),
    cut=st.integers(min_value=0, max_value=40),
)
def test_decayed_trie_halves_every_count_and_keeps_every_edge_and_order(answers, depth, halvings, cut):
    """The array-built decay (a Python walk over a full pool stalled every request for 6-9 s) gives
    what halving every count and dropping the zeros means: counts, children's order, the edges
    that find() walks, after an insert cut back part way too; and the copy takes inserts again."""
    trie = NGramTrie(depth)
    for answer in answers:
        trie.insert(answer)
    if answers:
        trie.cut_back(max(0, trie.nodes - cut))  # an insert stopped part way
    for _ in range(halvings):
        expected = {path: count // 2 for path, count in _trie_counts(trie).items() if count // 2}
        orders = {
            path: [t for t in order if path + (t,) in expected]
            for path, order in _children_orders(trie).items()
            if not path or path in expected
        }
        trie = trie.decayed()
        assert _trie_counts(trie) == expected
        assert _children_orders(trie) == orders
        assert trie.nodes == len(expected)
        assert all(trie.count(trie.find(path)) == count for path, count in expected.items())
    trie.insert([1, 2, 3])
    assert trie.find([1, 2][:depth]) is not None


def test_the_trie_holds_no_objects_the_garbage_collector_walks():
    import gc

    pool = ContextPool(depth=8)
    pool.extend(list(range(3000)))
    before = len(gc.get_objects())
    pool.extend(list(range(3000, 6000)))  # 12,000 more n-grams indexed
    assert len(gc.get_objects()) - before < 100


def test_output_pool_is_safe_under_concurrent_writers():
    pool = OutputPool(depth=4, max_nodes=500)

    def writer(offset):
        for i in range(200):
            pool.add([offset, i % 50, (i * 7) % 50, offset])

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < pool.nodes <= 500
    assert pool.nodes == len(_trie_counts(pool.trie))


def _is_tree(draft: DraftTree) -> bool:
    for i, parent in enumerate(draft.parents):
        if parent >= i:
            return False
        if (parent == -1 and draft.depths[i] != 1) or (parent >= 0 and draft.depths[i] != draft.depths[parent] + 1):
            return False
        if parent >= 0 and draft.probs[i] > draft.probs[parent]:  # exactly: top(k) relies on it
            return False
    siblings = list(zip(draft.parents, draft.tokens))
    return len(siblings) == len(set(siblings))


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=80),
    previous=st.lists(st.integers(min_value=0, max_value=5), max_size=40),
    decoding_length=st.integers(min_value=1, max_value=40),
    branch_length=st.integers(min_value=1, max_value=10),
    k=st.integers(min_value=0, max_value=40),
)
def test_draft_trees_respect_limits_and_stay_trees(prompt, previous, decoding_length, branch_length, k):
    config = LookaheadConfig(decoding_length=decoding_length, branch_length=branch_length, stop_words=frozenset({0}))
    context = ContextPool(config.pool_depth)
    context.extend(prompt)
    output = OutputPool(config.pool_depth)
    output.add(previous)
    draft = propose(context, output, config)
    assert len(draft) <= decoding_length
    assert all(1 <= d <= branch_length for d in draft.depths)
    assert _is_tree(draft)
    assert _is_tree(draft.top(k)) and len(draft.top(k)) == min(k, len(draft))
    assert all(_is_tree(draft.top(j)) for j in range(len(draft)))  # every cut of the ranking is a tree
    assert _is_tree(draft.best_chain())
    assert _is_tree(draft.limit_depth(2)) and all(d <= 2 for d in draft.limit_depth(2).depths)


def test_longest_key_wins_and_frequencies_rank_children():
    config = LookaheadConfig(decoding_length=8, branch_length=3, max_key_length=2)
    context = ContextPool(5)
    # after "1 2" came "3" twice and "4" once; after "9 2" came "5"
    context.extend([1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 9, 2, 5, 0, 1, 2])
    draft = propose(context, None, config)
    first_level = [(t, p) for t, parent, p in zip(draft.tokens, draft.parents, draft.probs) if parent == -1]
    assert [t for t, _ in first_level] == [3, 4]  # "5" only follows "9 2", not the key "1 2"
    assert first_level[0][1] > first_level[1][1]


def test_a_stop_word_alone_is_never_a_key():
    config = LookaheadConfig(decoding_length=8, branch_length=3, stop_words=frozenset({0}))
    context = ContextPool(7)
    context.extend([5, 0, 6, 7, 8, 0])  # the text ends in the stop word 0; "0" was followed by "6"
    assert len(propose(context, None, config)) == 0
    context.extend([6])  # now the key "0 6" (two tokens) is allowed
    assert propose(context, None, config).tokens[:2] == [7, 8]


def test_a_key_that_ends_in_punctuation_the_source_lacks_skips_it():
    # the passage reads "5 6 7 8 9", the answer copies "5 6" and adds its own comma (0): no
    # suffix ending in the comma has a continuation, the words before it do
    config = LookaheadConfig(decoding_length=8, branch_length=3, stop_words=frozenset({0, 1}))
    context = ContextPool(7)
    context.extend([5, 6, 7, 8, 9, 2, 3, 5, 6, 0])
    assert propose(context, None, config).tokens == [7, 8, 9]
    # the source's own punctuation after the words (1, a semicolon) is skipped: the text has its comma
    context = ContextPool(7)
    context.extend([5, 6, 1, 7, 8, 2, 3, 5, 6, 0])
    assert propose(context, None, config).tokens == [7, 8, 2]
    # a key that ends in the comma and has a continuation still wins
    context = ContextPool(7)
    context.extend([5, 6, 0, 4, 4, 5, 6, 7, 8, 2, 5, 6, 0])
    assert propose(context, None, config).tokens[0] == 4
    # and a last token that is no stop word is never skipped
    context = ContextPool(7)
    context.extend([5, 6, 7, 8, 9, 2, 3, 5, 6, 11])
    assert len(propose(context, None, config)) == 0


def test_the_source_punctuation_the_text_typed_itself_is_not_drafted_again():
    """The text ends in its own stop word (99) after "2"; in the source "2" was once followed by
    that same 99. Drafting past it again would propose "3 4", a continuation whose punctuation
    the text already has, instead of what followed "2" otherwise."""
    config = LookaheadConfig(decoding_length=8, branch_length=3, max_key_length=1, stop_words=frozenset({99}))
    context = ContextPool(config.pool_depth, [[2, 99, 3, 4], [2, 10, 11]], key_length=config.max_key_length)
    context.extend([5, 2, 99])
    draft = propose(context, None, config)
    assert draft.tokens == [10, 11]
    assert draft.probs == [1.0, 1.0]  # the typed 99's share is not counted either


def test_a_key_past_the_texts_punctuation_drafts_as_deep_as_a_direct_key():
    """A key of ``max_key_length`` tokens before the text's own stop word: what followed it in the
    source is drafted to ``branch_length``, as after a key found directly. The stop word was
    counted into the key's length, which left such drafts a level short (depth 3 of 4 here),
    though the trie holds the whole continuation. A continuation found past a stop word in the
    source sits a level deeper in the trie and ends where the trie ends, never deeper."""
    config = LookaheadConfig(decoding_length=64, branch_length=4, max_key_length=2, stop_words=frozenset({98, 99}))
    context = ContextPool(config.pool_depth, [[1, 2, 10, 11, 12, 13, 14, 15]], key_length=config.max_key_length)
    context.extend([5, 1, 2, 99])  # the answer typed its own punctuation after "1 2"
    draft = propose(context, None, config)
    assert (draft.tokens, draft.depths) == ([10, 11, 12, 13], [1, 2, 3, 4])
    output = OutputPool(config.pool_depth)  # the same from the output pool's trie
    output.add([1, 2, 10, 11, 12, 13, 14, 15])
    empty = ContextPool(config.pool_depth)
    empty.extend([5, 1, 2, 99])
    assert propose(empty, output, config).tokens == [10, 11, 12, 13]
    # the source's own stop word (98) after "1 2": its continuation is one level deeper in a trie
    # of depth 6, so it stops at depth 3, where the trie ends
    context = ContextPool(config.pool_depth, [[1, 2, 98, 10, 11, 12, 13, 14]], key_length=config.max_key_length)
    context.extend([5, 1, 2, 99])
    assert propose(context, None, config).tokens == [10, 11, 12]


def test_both_pools_reaching_a_node_keep_the_surer_estimate():
    """The context saw "7 8" followed by 1, 2 and 3 once each (a third each); earlier answers
    followed it with 3 five times. Node 3 must carry the output pool's certainty, or the
    budget ranks the likeliest continuation no higher than the other two."""
    config = LookaheadConfig(decoding_length=8, branch_length=4)
    context = ContextPool(config.pool_depth, [[7, 8, 1], [7, 8, 2], [7, 8, 3]], key_length=config.max_key_length)
    context.extend([5, 7, 8])
    output = OutputPool(config.pool_depth)
    for _ in range(5):
        output.add([7, 8, 3])
    draft = propose(context, output, config)
    assert draft.probs[draft.tokens.index(3)] == 1.0
    assert draft.top(1).tokens == [3]


def test_the_best_chain_weighs_depth_by_probability():
    """A model that cannot take a tree mask verifies one chain: four likely tokens deep beat one
    slightly likelier token beside them (expected accepted tokens, not the likeliest leaf)."""
    tree = DraftTree(
        tokens=[1, 2, 3, 4, 9], parents=[-1, 0, 1, 2, -1], depths=[1, 2, 3, 4, 1], probs=[0.6, 0.6, 0.6, 0.6, 0.7]
    )
    assert tree.best_chain().tokens == [1, 2, 3, 4]


def test_top_ranks_nodes_by_probability_before_depth():
    """A deep likely node outranks shallow unlikely ones: the cut keeps the nodes likeliest to
    be accepted, whatever their depth."""
    tree = DraftTree(tokens=[1, 2, 3, 4], parents=[-1, -1, -1, 0], depths=[1, 1, 1, 2], probs=[0.9, 0.05, 0.05, 0.85])
    assert tree.top(2).tokens == [1, 4]
    assert tree.top(3).tokens == [1, 2, 4]  # ties go to the shallower node, then the earlier one


def test_limit_depth_drops_every_node_past_the_room():
    chain = DraftTree.chain([4, 5, 6])
    assert chain.limit_depth(3) is chain
    assert chain.limit_depth(2).tokens == [4, 5]
    assert chain.limit_depth(1).tokens == [4]


def test_within_vocab_drops_the_id_equal_to_the_vocabulary_size():
    """Ids run from 0 to vocab - 1: a draft token equal to ``vocab`` goes, with its subtree, on
    the fast path (no negative id) and on the slow one (a negative id beside it) alike."""
    vocab = 64
    kept = DraftTree([5, vocab - 1], [-1, 0], [1, 2], [1.0, 1.0])
    assert kept.within_vocab(vocab) is kept
    assert DraftTree([5, vocab], [-1, 0], [1, 2], [1.0, 1.0]).within_vocab(vocab).tokens == [5]
    slow = DraftTree([5, vocab, 7, -1], [-1, 0, 1, -1], [1, 2, 3, 1], [1.0, 1.0, 1.0, 1.0])
    assert slow.within_vocab(vocab).tokens == [5]


def test_a_full_tree_still_merges_what_the_output_pool_also_saw():
    """The context pool fills the tree (K -> z seven times, K -> a once); the output pool's
    candidates for K are x, w and a. x and w find no room, but a is already in the tree and its
    surer estimate (3 of 10) must still reach it, past the two that did not fit."""
    config = LookaheadConfig(decoding_length=3, branch_length=4, min_key_length=1, stop_words=())
    key, z, a, x, w = 100, 1, 2, 3, 4
    context = ContextPool(config.pool_depth, [[key, z]] * 7 + [[key, a]], key_length=config.max_key_length)
    context.extend([key])
    output = OutputPool(config.pool_depth)
    for answer in [[key, x]] * 4 + [[key, w]] * 3 + [[key, a]] * 3:
        output.add(answer)
    draft = propose(context, output, config)
    assert draft.tokens == [z, a, x]
    assert [round(p, 6) for p in draft.probs] == [0.875, 0.3, 0.4]


def test_context_pool_is_preferred_over_output_pool():
    config = LookaheadConfig(decoding_length=2, branch_length=1, max_key_length=1)
    context = ContextPool(4)
    context.extend([1, 2, 1])
    output = OutputPool(4)
    for _ in range(10):
        output.add([1, 3])
    draft = propose(context, output, config)
    assert draft.tokens[0] == 2  # from the context, though the output pool saw "1 3" more often
    assert set(draft.tokens) == {2, 3}


def test_a_child_never_outranks_its_parent_by_rounding():
    # ten continuations of 100 with 3 occurrences each (share 0.1), each followed by one token:
    # 0.1 * 3 / 3 rounds above 0.1, which once let top(k) keep a child without its parent
    trie = NGramTrie(4)
    for i in range(10):
        for _ in range(3):
            trie.insert([100, i, 50 + i])
    builder = _TreeBuilder(limit=20, max_depth=2)
    builder.grow(trie, children_of(trie, trie.find([100])), 2)
    draft = builder.tree
    assert len(draft) == 20
    assert _is_tree(draft)
    assert all(_is_tree(draft.top(k)) for k in range(len(draft) + 1))


class _TrieContext(NGramTrie):
    """The context pool as it was: every n-gram of the references and the stream in a trie."""

    def __init__(self, depth, references, stream):
        super().__init__(depth)
        for sequence in [*references, stream]:
            self.insert(sequence)
        self.stream = list(stream)


@settings(max_examples=400, deadline=None)
@given(
    references=st.lists(st.lists(st.integers(min_value=0, max_value=6), max_size=40), max_size=3),
    stream=st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=80),
    chunks=st.lists(st.integers(min_value=1, max_value=20), max_size=6),
    previous=st.lists(st.integers(min_value=0, max_value=6), max_size=30),
    decoding_length=st.integers(min_value=1, max_value=40),
    branch_length=st.integers(min_value=1, max_value=12),
    max_key_length=st.integers(min_value=1, max_value=5),
    key_length=st.integers(min_value=1, max_value=6),
    stop_words=st.sampled_from([frozenset(), frozenset({0}), frozenset({0, 1})]),
)
def test_the_context_pool_drafts_the_trees_a_trie_of_the_same_text_drafts(
    references, stream, chunks, previous, decoding_length, branch_length, max_key_length, key_length, stop_words
):
    """Same nodes, counts, children's order, hence the same draft trees to the last probability,
    whether the pool indexes keys as long as the drafter's or shorter (longer keys are walked)."""
    config = LookaheadConfig(
        decoding_length=decoding_length,
        branch_length=branch_length,
        max_key_length=max_key_length,
        stop_words=stop_words,
    )
    depth = branch_length + max_key_length
    pool = ContextPool(depth, references, key_length=key_length)
    output = OutputPool(depth)
    output.add(previous)
    done = 0
    for size in [*chunks, len(stream)]:  # the prompt, then the answer a few tokens a step
        pool.extend(stream[done : done + size])
        done = min(len(stream), done + size)
        trie = _TrieContext(depth, references, stream[:done])
        assert propose(pool, output, config) == propose(trie, output, config)
        assert propose(pool, None, config) == propose(trie, None, config)
    assert pool.stream == stream


def test_a_key_with_thousands_of_occurrences_drafts_from_its_latest_ones():
    """A long run of one token: every level of the draft would group all its occurrences."""
    import time

    config = LookaheadConfig(decoding_length=64, branch_length=48)
    pool = ContextPool(52, key_length=4)
    pool.extend([7] * 50_000 + [8, 9] + [7] * 10)
    node = pool.find([7, 7, 7, 7])
    assert pool.count(node) == ContextPool.MOST_OCCURRENCES
    assert node.ends[-1] == len(pool.stream) - 1  # the latest occurrences
    start = time.perf_counter()
    draft = propose(pool, None, config)
    assert time.perf_counter() - start < 1.0  # all 50,000 at each of 48 levels took seconds
    assert draft.tokens[0] == 7


class _Interrupting(list):
    """A trie column that raises KeyboardInterrupt at its ``at``-th write (append or item set)."""

    def __init__(self, values, method: str, at: int) -> None:
        super().__init__(values)
        self.method, self.left = method, at

    def _tick(self, method: str) -> None:
        if method == self.method:
            self.left -= 1
            if self.left == 0:
                raise KeyboardInterrupt

    def append(self, value) -> None:
        self._tick("append")
        super().append(value)

    def __setitem__(self, index, value) -> None:
        self._tick("set")
        super().__setitem__(index, value)


class _InterruptingEdges(dict):
    def __init__(self, values, at: int) -> None:
        super().__init__(values)
        self.left = at

    def __setitem__(self, key, value) -> None:
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt
        super().__setitem__(key, value)


@settings(max_examples=150, deadline=None)
@given(
    before=st.lists(sequences, max_size=3),
    interrupted=st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=40),
    after=sequences,
    column=st.sampled_from(
        ["_edges", "_counts:append", "_tokens:append", "_first:append", "_last:append", "_sibling:append"]
        + ["_first:set", "_last:set", "_sibling:set"]
    ),
    at=st.integers(min_value=1, max_value=30),
)
def test_an_insert_interrupted_anywhere_leaves_the_pool_as_before(before, interrupted, after, column, at):
    """A Ctrl-C inside OutputPool.add (as an answer retires) left the edges and node arrays out of
    step, and every later lookup on that model's pool raised IndexError. The insert is undone:
    the same n-grams as before it, and later inserts and lookups work."""
    pool = OutputPool(depth=4, max_nodes=10**6)
    for tokens in before:
        pool.add(tokens)
    paths, nodes = set(_trie_counts(pool.trie)), pool.nodes
    trie = pool.trie
    name, _, method = column.partition(":")
    flaky = _InterruptingEdges(trie._edges, at) if name == "_edges" else _Interrupting(getattr(trie, name), method, at)
    setattr(trie, name, flaky)
    try:
        pool.add(interrupted)
    except KeyboardInterrupt:
        assert set(_trie_counts(pool.trie)) == paths and pool.nodes == nodes
    else:  # it made fewer writes than ``at``: the insert finished
        assert set(_trie_counts(pool.trie)) == paths | set(_ngram_counts(interrupted, 4))
    flaky.left = 0  # no more interrupts
    trie = pool.trie
    assert len({len(c) for c in (trie._counts, trie._tokens, trie._first, trie._last, trie._sibling)}) == 1
    assert all(child < len(trie._counts) for child in trie._edges.values())
    expected = set(_trie_counts(trie)) | set(_ngram_counts(after, 4))
    pool.add(after)
    assert set(_trie_counts(pool.trie)) == expected
    for path in expected | {()}:  # every path is found, and its children listed once, oldest first
        children = [child for _, child in pool.trie.children(pool.trie.find(path))]
        assert children == sorted(set(children))


def test_a_trim_interrupted_while_its_traceback_is_kept_leaves_the_pool_usable(monkeypatch):
    """A Ctrl-C inside the trim's count, its traceback kept (IPython's last traceback, a Future's
    exception), held a numpy view of the count array: every later add failed with BufferError."""
    import numpy as np

    pool = OutputPool(depth=3, max_nodes=20)
    for i in range(5):
        pool.add([i, i + 1, i + 2])
    real_count = np.count_nonzero

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(np, "count_nonzero", real_count)
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "count_nonzero", interrupted)
    kept = []
    try:
        pool.add([50, 51, 52, 53, 54, 55, 56, 57])  # past the cap: trims
    except KeyboardInterrupt as stop:
        kept.append(stop)  # its traceback holds the trim's frame
    assert kept
    pool.add([60, 61, 62])  # a BufferError here before
    assert pool.nodes <= pool.max_nodes and pool.nodes == len(_trie_counts(pool.trie))

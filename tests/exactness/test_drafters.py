"""Drafters behind the same loop: prompt lookup proposes what transformers proposes, and any
drafter stays lossless (greedy equals ``model.generate(do_sample=False)``, sampling equals it under
the same seed) in fp32 on every tiny architecture."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, reference_generate, tiny_model
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.drafter import Drafter, PromptLookupDrafter
from rag_lookahead.decoding.loop import DecodeBatch
from rag_lookahead.decoding.rows import Row
from rag_lookahead.decoding.trie import NGramTrie, OutputPool
from rag_lookahead.errors import ConfigError

tokens = st.integers(min_value=1, max_value=12)


def transformers_candidates(sequence: list[int], max_ngram: int, num_pred: int) -> list[int]:
    """What transformers' own prompt lookup proposes after ``sequence`` (no length cap, no EOS)."""
    generator = PromptLookupCandidateGenerator(
        num_output_tokens=num_pred, max_matching_ngram_size=max_ngram, max_length=len(sequence) + 10_000
    )
    candidates, _ = generator.get_candidates(torch.tensor([sequence]))
    return candidates[0, len(sequence) :].tolist()


@settings(max_examples=300, deadline=None)
@given(
    sequence=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=60),
    max_ngram=st.integers(min_value=1, max_value=5),
    num_pred=st.integers(min_value=1, max_value=12),
    cuts=st.lists(st.integers(min_value=1, max_value=60), max_size=4),
)
def test_prompt_lookup_proposes_what_transformers_proposes(sequence, max_ngram, num_pred, cuts):
    """At every point of a row's life (its index grows as tokens arrive), the same chain as transformers."""
    drafter = PromptLookupDrafter(max_ngram=max_ngram, num_pred_tokens=num_pred)
    points = sorted({min(c, len(sequence)) for c in cuts} | {len(sequence)})
    row = Row(0, sequence[: points[0]], max_new_tokens=10_000, chooser=None, context_limit=None)
    drafter.start(row, [])
    for end in points:
        row.generated.extend(sequence[row.length : end])
        drafter.observe(row, DraftTree(), [])
        draft = drafter.propose(row)
        assert draft.tokens == transformers_candidates(sequence[:end], max_ngram, num_pred)
        assert draft.parents == list(range(-1, len(draft) - 1))  # one chain
        assert draft.depths == list(range(1, len(draft) + 1)) and draft.probs == [1.0] * len(draft)


@st.composite
def cases(draw):
    motif = draw(st.lists(tokens, min_size=2, max_size=8))
    prompt = (motif * 6)[: draw(st.integers(min_value=1, max_value=40))] + draw(st.lists(tokens, max_size=5))
    config = LookaheadConfig(budget=draw(st.sampled_from(["fixed", "auto"])), use_output_pool=False)
    drafter = PromptLookupDrafter(
        max_ngram=draw(st.integers(min_value=1, max_value=4)), num_pred_tokens=draw(st.integers(1, 12))
    )
    return prompt, draw(st.integers(1, 40)), config, drafter, draw(st.booleans())


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_prompt_lookup_through_our_loop_equals_greedy(arch, case):
    prompt, max_new, config, drafter, eos_inside = case
    model = tiny_model(arch)
    expected = reference_generate(model, prompt, max_new, None)
    eos = expected[len(expected) // 2] if eos_inside else None
    if eos is not None:
        expected = reference_generate(model, prompt, max_new, eos)
    result = generate(
        model, prompt, max_new_tokens=max_new, config=config, drafter=drafter, eos_token_id=eos, pad_token_id=0
    )
    assert result.sequences[0, len(prompt) :].tolist() == expected
    assert result.stats.new_tokens == len(expected)


def test_prompt_lookup_accepts_blocks_where_the_text_repeats():
    model = tiny_model("qwen2")
    prompt = [3, 4, 5, 6, 7, 8, 9, 10]
    truth = reference_generate(model, prompt, 30, None)
    prompt = prompt + truth + prompt  # the answer to the prompt's last words is in the prompt
    expected = reference_generate(model, prompt, 30, None)
    config = LookaheadConfig(budget="fixed")
    result = generate(model, prompt, max_new_tokens=30, config=config, drafter=PromptLookupDrafter(3, 10))
    assert result.sequences[0, len(prompt) :].tolist() == expected
    assert result.stats.mean_accepted > 2


def test_the_trie_drafts_from_the_answer_so_far():
    """Without references or an output pool, the context pool still learns the row's own
    answer as it grows: where the greedy continuation falls into a loop, the loop is drafted
    and accepted in blocks (12 steps for 60 tokens; 59 once the accepted tokens stopped reaching it)."""
    model = tiny_model("qwen2")
    prompt, max_new = [3, 4], 60
    expected = reference_generate(model, prompt, max_new, None)
    config = LookaheadConfig(decoding_length=12, branch_length=6, budget="fixed", use_output_pool=False)
    result = generate(model, prompt, max_new_tokens=max_new, config=config)
    assert result.sequences[0, len(prompt) :].tolist() == expected
    assert result.stats.row_steps < 25 and result.stats.mean_accepted > 2.5


def test_generate_drafts_from_the_models_own_output_pool_by_default():
    """With no pool passed in, ``generate`` keeps one per model: asked the same again, it drafts
    the earlier answer whole."""
    from rag_lookahead.tiny import build_tiny_model

    model = build_tiny_model("qwen2")  # its own, empty output pool
    prompt, max_new = [5, 9, 3, 7, 2, 8, 4, 6], 30
    expected = reference_generate(model, prompt, max_new, None)
    config = LookaheadConfig(decoding_length=12, branch_length=6, budget="fixed")
    steps = []
    for _ in range(2):
        result = generate(model, prompt, max_new_tokens=max_new, config=config)
        assert result.sequences[0, len(prompt) :].tolist() == expected
        steps.append(result.stats.row_steps)
    assert steps[1] <= max_new // 3 < steps[0]


class ChainOfTheAnswer(Drafter):
    """Proposes the true continuation, as deep as the row's whole room (one node too deep)."""

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer

    def propose(self, row: Row) -> DraftTree:
        done = len(row.generated)
        return DraftTree.chain(self.answer[done : done + row.room])


@pytest.mark.parametrize("max_new", [3, 6])
def test_no_draft_node_is_verified_past_the_rows_room(max_new):
    """The bonus token needs no draft: with ``room`` tokens left a draft is cut to ``room - 1``
    levels, so the whole answer after the first token is one step with ``max_new - 2`` nodes."""
    model = tiny_model("qwen2")
    prompt = [5, 9, 3, 7, 2, 8]
    expected = reference_generate(model, prompt, max_new, None)
    config = LookaheadConfig(budget="fixed", use_output_pool=False)
    result = generate(model, prompt, max_new_tokens=max_new, config=config, drafter=ChainOfTheAnswer(expected))
    assert result.sequences[0, len(prompt) :].tolist() == expected
    assert result.stats.draft_tokens == max_new - 2 and result.stats.forward_passes == 1


def test_a_draft_token_equal_to_the_vocabulary_size_is_dropped():
    """Ids run to ``vocab - 1``; a user's drafter proposing ``vocab`` itself (alone, or beside a
    negative id, which takes the slow path) must not reach the embedding."""
    model = tiny_model("qwen2")
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = [1, 2, 3]
    expected = reference_generate(model, prompt, 6, None)

    class Edge(Drafter):
        def __init__(self, tree: DraftTree) -> None:
            self.tree = tree

        def propose(self, row: Row) -> DraftTree:
            return self.tree

    for tree in (DraftTree([vocab], [-1], [1], [1.0]), DraftTree([vocab, -1], [-1, -1], [1, 1], [1.0, 1.0])):
        result = generate(model, prompt, max_new_tokens=6, config=LookaheadConfig(budget="fixed"), drafter=Edge(tree))
        assert result.sequences[0, len(prompt) :].tolist() == expected


@pytest.mark.parametrize("arch", ["qwen2", "llama", "glm4"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.lists(tokens, min_size=1, max_size=30), min_size=2, max_size=4),
    max_new=st.integers(min_value=1, max_value=30),
    eos=st.one_of(st.none(), tokens),
)
def test_prompt_lookup_batch_rows_match_single_rows(arch, prompts, max_new, eos):
    model = tiny_model(arch)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = LookaheadConfig(budget="fixed")
    result = generate(
        model, ids, mask, max_new_tokens=max_new, config=config, drafter=PromptLookupDrafter(), eos_token_id=eos
    )
    expected = [reference_generate(model, p, max_new, eos) for p in prompts]
    for row, want in enumerate(expected):
        assert result.sequences[row, width : width + len(want)].tolist() == want


def hf_sample(model, prompt, max_new, seed, **options):
    ids = torch.tensor([prompt])
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, pad_token_id=0, **options)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=cases(),
    temperature=st.floats(min_value=0.3, max_value=1.5),
    top_p=st.floats(min_value=0.5, max_value=1.0),
    seed=st.integers(0, 2**16),
)
def test_prompt_lookup_sampling_equals_hf_sampling_under_the_same_seed(arch, case, temperature, top_p, seed):
    prompt, max_new, config, drafter, _ = case
    model = tiny_model(arch)
    options = {"do_sample": True, "temperature": temperature, "top_p": top_p}
    expected = hf_sample(model, prompt, max_new, seed, **options)
    torch.manual_seed(seed)
    result = generate(model, prompt, max_new_tokens=max_new, config=config, drafter=drafter, pad_token_id=0, **options)
    assert result.sequences[0, len(prompt) :].tolist() == expected


class NoiseDrafter(Drafter):
    """Proposes random trees from its own generator: wrong nearly always, ids the model does not
    have now and then (-1, 10**6), and still harmless."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def propose(self, row: Row) -> DraftTree:
        draft = DraftTree()
        for i in range(self.random.randint(0, 12)):
            draft.tokens.append(self.random.choice([*range(1, 13), -1, 10**6]))
            draft.parents.append(self.random.randint(-1, i - 1))
            draft.depths.append(1 if draft.parents[-1] < 0 else draft.depths[draft.parents[-1]] + 1)
            draft.probs.append(0.5 ** draft.depths[-1])
        return draft


@pytest.mark.parametrize("arch", ["qwen3", "glm"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(tokens, min_size=1, max_size=30), max_new=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_any_drafter_is_lossless(arch, prompt, max_new, seed):
    model = tiny_model(arch)
    config = LookaheadConfig(budget="fixed")
    result = generate(model, prompt, max_new_tokens=max_new, config=config, drafter=NoiseDrafter(seed))
    assert result.sequences[0, len(prompt) :].tolist() == reference_generate(model, prompt, max_new, None)


class MislabelledDrafter(Drafter):
    """Proposes the right answer (and a decoy) with wrong depths and probabilities that grow down
    the path or are NaN: the loop must take depths from the parents (they are positions) and
    still cut the tree by its probabilities."""

    def __init__(self, answer: list[int], seed: int) -> None:
        self.answer, self.random = answer, random.Random(seed)

    def propose(self, row: Row) -> DraftTree:
        chain = self.answer[len(row.generated) : len(row.generated) + 6]
        count = len(chain) + 1
        return DraftTree(
            tokens=[*chain, 95],
            parents=[*range(-1, len(chain) - 1), -1],
            depths=[self.random.choice([1, 3, 7]) for _ in range(count)],
            probs=[self.random.choice([0.1, 0.9, 1.5, float("nan")]) for _ in range(count)],
        )


@pytest.mark.parametrize("budget", ["fixed", "auto"])
def test_a_drafters_depths_and_probabilities_are_not_trusted(budget):
    model = tiny_model("llama")
    rng = random.Random(0)
    for case in range(6):
        prompt = [rng.randint(1, 95) for _ in range(rng.randint(3, 20))]
        expected = reference_generate(model, prompt, 20, None)
        drafter = MislabelledDrafter(expected, case)
        result = generate(model, prompt, max_new_tokens=20, config=LookaheadConfig(budget=budget), drafter=drafter)
        assert result.sequences[0, len(prompt) :].tolist() == expected
        assert result.stats.forward_passes < 20  # the right answer was drafted and taken in blocks


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (DraftTree([5, 6], [-1], [1], [1.0]), "as many parents"),
        (DraftTree([5, 6], [-1, 1], [1, 2], [1.0, 1.0]), "earlier node"),
        (DraftTree([5, 6], [-1, -2], [1, 1], [1.0, 1.0]), "earlier node"),
        (DraftTree([5, 6.0], [-1, 0], [1, 2], [1.0, 1.0]), "must be ints"),
        (DraftTree([5, 6], [-1, 0], [1, 2], [1.0, None]), "is not a number"),
    ],
)
def test_a_tree_that_cannot_be_read_is_refused(tree, message):
    class Fixed(Drafter):
        def propose(self, row: Row) -> DraftTree:
            return tree

    with pytest.raises(ValueError, match=message):
        generate(tiny_model("llama"), [1, 2, 3], max_new_tokens=4, drafter=Fixed())


def test_a_pool_filled_before_the_vocabulary_shrank_drafts_only_ids_the_model_has():
    """``resize_token_embeddings`` to fewer ids after a call: the model's output pool still held
    the larger ids and drafted them (a raw IndexError in the embedding)."""
    from rag_lookahead.tiny import build_tiny_model

    model = build_tiny_model("qwen2")
    first = generate(model, [5, 6, 7, 8, 9, 10, 11, 12], max_new_tokens=40).sequences[0, 8:].tolist()
    assert max(first) >= 64  # the pool holds ids past the new vocabulary
    model.resize_token_embeddings(64)
    prompt = [5, 6, 7, 8, 9]
    result = generate(model, prompt, max_new_tokens=30)
    assert result.sequences[0, len(prompt) :].tolist() == reference_generate(model, prompt, 30, None)


def test_the_output_pool_belongs_to_the_trie_drafter():
    model = tiny_model("qwen2")
    with pytest.raises(ConfigError, match="output_pool"):
        DecodeBatch(model, LookaheadConfig(), frozenset(), OutputPool(8), drafter=PromptLookupDrafter())
    with pytest.raises(ConfigError, match="max_ngram"):
        PromptLookupDrafter(max_ngram=0)


def _decode_with_batch(model, prompt, max_new, config, pool):
    """``prompt`` decoded through a ``DecodeBatch`` stepped by hand (as the server steps it)."""
    batch = DecodeBatch(model, config, frozenset(), pool)
    batch.add(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), None, max_new, keys=["only"])
    generated = []
    while batch.rows:
        batch.verify_and_accept(batch.propose())
        generated += [row.generated for row in batch.retire()]
    return generated[0]


def test_use_output_pool_false_neither_reads_nor_fills_a_pool_passed_in():
    """``LookaheadConfig(use_output_pool=False)`` is the switch that keeps answers from being
    drafted from one another (a measurement of the context pool alone, say): an output pool
    handed in anyway must be neither read nor filled, through ``generate`` and through a
    ``DecodeBatch`` alike."""
    model = tiny_model("qwen2")
    prompt, max_new = [5, 9, 3, 7, 2, 8, 4, 6], 24
    expected = reference_generate(model, prompt, max_new, None)
    off, on = (LookaheadConfig(budget="fixed", use_output_pool=use) for use in (False, True))

    def forwards(config, pool):
        result = generate(model, prompt, max_new_tokens=max_new, config=config, output_pool=pool)
        assert result.sequences[0, len(prompt) :].tolist() == expected
        return result.stats.forward_passes

    empty = OutputPool(off.pool_depth)
    without_pool = forwards(off, None)
    assert forwards(off, empty) == without_pool and empty.nodes == 0  # not filled
    assert _decode_with_batch(model, prompt, max_new, off, empty) == expected and empty.nodes == 0
    known = OutputPool(off.pool_depth)
    known.add(expected)  # an earlier answer that drafts this one whole
    nodes = known.nodes
    assert forwards(off, known) == without_pool and known.nodes == nodes  # not read, not added to
    assert forwards(on, known) < without_pool  # the control: switched on, the same pool pays


def test_only_the_answer_enters_the_output_pool():
    """A row that leaves adds its answer's n-grams to the shared pool, not its prompt's: prompts
    (retrieved passages, mostly) are long, so the pool filled and decayed many times faster, with
    text the row's own context pool already drafts from."""
    model = tiny_model("qwen2")
    prompt = [(7 * i) % 90 + 1 for i in range(40)]
    config = LookaheadConfig(budget="fixed")
    pool = OutputPool(config.pool_depth)
    answer = generate(model, prompt, max_new_tokens=6, config=config, output_pool=pool).sequences[0, 40:].tolist()
    alone = NGramTrie(config.pool_depth)
    alone.insert(answer)
    assert pool.nodes == alone.nodes and pool.trie.find(prompt[:2]) is None

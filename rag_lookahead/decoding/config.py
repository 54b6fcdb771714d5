"""Configuration of lookahead decoding.

One dataclass holds every knob of the drafter and the verifier so that the CLI flags,
the LangChain wrapper and the benchmark all mirror the same names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import TYPE_CHECKING, Literal

from rag_lookahead.errors import ConfigError

if TYPE_CHECKING:
    from rag_lookahead.checks import Integer

#: Text pieces that are too common to predict anything when used alone as a lookup key.
DEFAULT_STOP_WORDS: tuple[str, ...] = (
    ",",
    ".",
    " ",
    "\n",
    "，",
    "。",
    "、",
    "：",
    ":",
    "；",
    ";",
    "！",
    "？",
    "!",
    "?",
)


#: Upper bounds keep one bad value from building a huge mask or trie: a draft of
#: ``decoding_length`` nodes costs a (nodes x nodes) mask per step, and the trie depth is
#: ``branch_length + max_key_length`` (``LookaheadConfig.pool_depth``).
_UPPER_BOUNDS = {
    "decoding_length": 1024,
    "branch_length": 256,
    "max_key_length": 64,
    "min_key_length": 64,
    "output_pool_nodes": 100_000_000,
}


WORDS_ADVICE = "for words, use LookaheadConfig().with_tokenizer(tokenizer, words)"


def checked_stop_word_ids(words, words_advice: str = WORDS_ADVICE) -> frozenset[int]:
    """Stop words are token ids; text is refused (``with_tokenizer`` turns words into ids).
    ``words_advice``: how the caller's API takes words instead (``model.generate`` takes them otherwise)."""
    if isinstance(words, (str, bytes)):
        raise ConfigError("stop_words are token ids, not text: use LookaheadConfig().with_tokenizer(tokenizer)")
    try:
        items = list(words)
    except TypeError:
        raise ConfigError(f"stop_words must be a set of token ids, got {words!r}") from None
    for item in items:
        if isinstance(item, bool) or not isinstance(item, Integral) or item < 0:
            raise ConfigError(f"stop_words must be non-negative token ids, got {item!r} ({words_advice})")
    return frozenset(int(t) for t in items)


@dataclass(frozen=True)
class LookaheadConfig:
    """Knobs of the drafter and verifier.

    Frozen: a changed copy is ``config.replace(field=value)`` (or ``dataclasses.replace``), which
    checks the new value. Fields were assignable, and an assignment skipped the checks: a
    ``max_key_length`` of 0 or text ``stop_words`` failed deep in the drafter, a negative
    ``decoding_length`` or an unknown ``budget`` ran silently (and a config may be shared by the
    decodes of a LangChain model or a server while one runs).

    decoding_length: most draft nodes verified in one forward (the tree size cap).
    branch_length: deepest draft path, i.e. most draft tokens one step can accept. 48 (was 24,
        and 12 before that): a step accepts at most ``branch_length + 1`` tokens, and on
        answers that copy that cap is what limits the speed. The auto budget learns per row how
        deep its drafts keep being accepted (judging even the nodes it cut, by the bonus token),
        so the deeper cap costs little where answers paraphrase. Measured (realistic English
        answers that copy the passage, fp32, batch 1): 24 -> 48 raised lookahead from 1.22x to
        1.50x prompt lookup, Chinese answers that paraphrase 1.11x -> 1.13x (README, Benchmarks).
    stop_words: token ids never used alone as a lookup key (see ``with_tokenizer``).
    enabled: False decodes plainly (one token a forward) through the same loop.
    budget: "auto" sizes each draft from the measured cost of a forward of k tokens and the
        trie's estimate of how many draft tokens will be accepted; "fixed" always verifies up
        to ``decoding_length`` nodes (useful for tests and for GPUs, where cost is flat).
    max_key_length: longest suffix of the text used as a lookup key.
    min_key_length: shortest key that may still be used (1 = a single token).
    output_pool_nodes: node cap of the shared pool of earlier answers (memory bound).
    use_output_pool: draft also from n-grams of earlier answers.
    debug: keep a per-step trace in ``GenerationResult.stats.trace``.
    """

    decoding_length: int = 64
    branch_length: int = 48
    stop_words: frozenset[int] = field(default_factory=frozenset)
    enabled: bool = True
    budget: Literal["auto", "fixed"] = "auto"
    max_key_length: int = 4
    min_key_length: int = 1
    output_pool_nodes: int = 2_000_000
    use_output_pool: bool = True
    debug: bool = False

    # What the generated __init__ takes, for type checkers (the fields' types are what ``validate``
    # stores): numpy integers for the integer fields, any iterable of ids for ``stop_words``.
    # tests/unit/test_public_names.py checks it against the fields.
    if TYPE_CHECKING:

        def __init__(
            self,
            decoding_length: Integer = 64,
            branch_length: Integer = 48,
            stop_words: Iterable[Integer] = frozenset(),
            enabled: bool = True,
            budget: Literal["auto", "fixed"] = "auto",
            max_key_length: Integer = 4,
            min_key_length: Integer = 1,
            output_pool_nodes: Integer = 2_000_000,
            use_output_pool: bool = True,
            debug: bool = False,
        ) -> None: ...

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse a bad value (ConfigError); store integers as ``int`` and stop words as a frozenset."""
        for name, high in _UPPER_BOUNDS.items():
            value = getattr(self, name)
            if not isinstance(value, Integral) or isinstance(value, bool) or not 1 <= value <= high:
                raise ConfigError(f"{name} must be an integer from 1 to {high:,}, got {value!r}")
            object.__setattr__(self, name, int(value))  # a numpy integer as stop_words and max_new_tokens take it
        for name in ("enabled", "use_output_pool", "debug"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.min_key_length > self.max_key_length:
            raise ConfigError(
                f"min_key_length ({self.min_key_length}) must not exceed max_key_length ({self.max_key_length})"
            )
        if self.budget not in ("auto", "fixed"):
            raise ConfigError(f"budget must be 'auto' or 'fixed', got {self.budget!r}")
        object.__setattr__(self, "stop_words", checked_stop_word_ids(self.stop_words))

    @property
    def pool_depth(self) -> int:
        """Depth of the n-gram pools (the prompt's and the earlier answers'): the longest lookup key
        plus the deepest draft path it leads to."""
        return self.branch_length + self.max_key_length

    def replace(self, **changes) -> LookaheadConfig:
        return replace(self, **changes)

    def with_tokenizer(self, tokenizer, words: Iterable[str] = DEFAULT_STOP_WORDS) -> LookaheadConfig:
        """Return a copy whose stop words are the single-token ids of ``words`` for this tokenizer."""
        return self.replace(stop_words=self.stop_words | stop_word_ids(tokenizer, words))


def config_or_default(config: LookaheadConfig | None) -> LookaheadConfig:
    """``config``, or the defaults for None; anything else is a ConfigError naming what came (a
    dict reached the decoder as "'dict' object has no attribute 'enabled'")."""
    if config is None:
        return LookaheadConfig()
    if not isinstance(config, LookaheadConfig):
        hint = " (a dict of its fields: LookaheadConfig(**fields))" if isinstance(config, dict) else ""
        raise ConfigError(f"config must be a LookaheadConfig{hint}, got {type(config).__name__}")
    return config


def stop_word_ids(tokenizer, words: Iterable[str] = DEFAULT_STOP_WORDS) -> frozenset[int]:
    """Ids of the words that the tokenizer encodes as exactly one token."""
    ids: set[int] = set()
    for word in words:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) == 1:
            ids.add(int(encoded[0]))
    return frozenset(ids)

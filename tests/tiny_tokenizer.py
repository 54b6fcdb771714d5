"""A word-level tokenizer for the tiny models' vocabulary: token ``i`` is the word ``t{i}``
(except the pad ``<pad>`` = 0, the end of turn ``<eos>`` = 3 and four role words at the end).

Tests that need a tokenizer (text references, chat templates, model folders) use it with the
random-weight models of ``tiny_models``; no download.
"""

from __future__ import annotations

from tiny_models import VOCAB

CHAT_TEMPLATE = (
    "{% for m in messages %}t2 {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}t2 assistant {% endif %}"
)


def tiny_tokenizer():
    """``PreTrainedTokenizerFast`` over ``t0 .. t{VOCAB-1}`` plus the role words, split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 4)}
    vocab = {("<pad>" if i == 0 else "<eos>" if i == 3 else word): i for word, i in vocab.items()}
    vocab.update({"system": VOCAB - 4, "user": VOCAB - 3, "assistant": VOCAB - 2, "tunk": VOCAB - 1})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="tunk"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="tunk", pad_token="<pad>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer

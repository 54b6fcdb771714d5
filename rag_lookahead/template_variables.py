"""Template variables a caller may add to the chat template (Qwen3's ``enable_thinking``), and the
names they may not take.

The server's ``chat_template_kwargs`` and ``ChatLookahead``'s field of that name pass more
variables to ``apply_chat_template``; a variable named like one of its own arguments
(``add_generation_prompt``, ``tools``, ...) would reach it as that argument, and set what the
front end sets itself. Both refuse those names through :func:`reserved_names`, so the two cannot
drift apart.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable

__all__ = ["TEMPLATE_ARGUMENTS", "reserved_names", "template_arguments"]

#: apply_chat_template's own arguments: a template variable of one of these names is not passed
TEMPLATE_ARGUMENTS = frozenset(
    (
        "conversation messages tools documents chat_template add_generation_prompt continue_final_message "
        "tokenize padding truncation max_length return_tensors return_dict return_assistant_tokens_mask "
        "tokenizer_kwargs self"
    ).split()
)


@functools.cache
def template_arguments() -> frozenset[str]:
    """``TEMPLATE_ARGUMENTS`` and whatever the installed transformers' ``apply_chat_template`` takes
    besides (5.24 added ``sanitize_control_tokens``: passed on, it broke the template call)."""
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    named = (p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    return TEMPLATE_ARGUMENTS.union(named)


def reserved_names(variables: Iterable[str] | None) -> list[str]:
    """The names among ``variables`` (a mapping's keys) that are ``apply_chat_template``'s own
    arguments, sorted: the front end sets those, so a template variable may not."""
    return sorted(template_arguments().intersection(variables or ()))

"""transformers' generation options in a request body, which the server does not read.

Clients written for transformers-style servers send ``model.generate``'s names (``max_new_tokens``,
``do_sample``, ``suppress_tokens``, ...). The body drops fields it does not know, so each of these
was answered as if it had not been asked: ``suppress_tokens`` still gave the suppressed token,
``max_new_tokens: 40`` gave the server's default length. Here each is refused unless its value
changes nothing, with the name the server takes for it where there is one.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from rag_lookahead.decoding.sampling import MIN_TEMPERATURE, UNSUPPORTED_NEUTRAL

#: the highest ``temperature`` the endpoints take (OpenAI's bound)
MAX_TEMPERATURE = 2.0


def _with_int_forms(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """The neutral values as JSON sends them: ``1.0`` may come as ``1``; None is "left out" anyway."""
    kept = [v for v in values if v is not None]
    ints = [int(v) for v in kept if isinstance(v, float) and v.is_integer()]
    return tuple(kept + ints)


#: the options the decoding core refuses in a generation config (same values neutral), and the
#: lengths and end ids the server sets from its own fields and the model
TRANSFORMERS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    **{name: _with_int_forms(values) for name, values in UNSUPPORTED_NEUTRAL.items()},
    "max_new_tokens": (),
    "max_length": (),
    "eos_token_id": (),
}

#: the server's own field for some of them (advised where the endpoint has that field)
SERVER_NAMES = {
    "max_new_tokens": "max_tokens",
    "max_length": "max_tokens",
    "stop_strings": "stop",
    "num_return_sequences": "n",
}


def neutral(value: Any, values: tuple[Any, ...]) -> bool:
    """``value`` is absent (None) or one of ``values``, type and all (``True`` is not ``1``)."""
    return value is None or any(type(value) is type(v) and value == v for v in values)


def refused_generate_option(
    data: Any,
    skip: frozenset[str] = frozenset(),
    fields: Collection[str] = (),
    greedy_only: bool = False,
) -> tuple[str, str] | None:
    """The first transformers option of the raw body ``data`` that would change the answer, with the
    refusal's words; None where there is none. ``skip``: names the endpoint reads or judges itself;
    ``fields``: the endpoint's own fields (the advice names only those); ``greedy_only``: it answers greedily.

    ``do_sample`` passes where it agrees with ``temperature`` (which decides here: 0 or absent is
    greedy), so ``do_sample: true`` at the default temperature is refused, not answered greedily."""
    if not isinstance(data, dict):
        return None
    if "do_sample" not in skip and data.get("do_sample") is not None:
        refused = _refused_do_sample(data["do_sample"], data.get("temperature"), greedy_only)
        if refused is not None:
            return "do_sample", refused
    for name, values in TRANSFORMERS_NEUTRAL.items():
        if name in skip or neutral(data.get(name), values):
            continue
        ours = SERVER_NAMES.get(name)
        instead = f"send {ours!r} instead" if ours in fields else "leave it out"
        return name, f"'{name}' (a transformers generation option) is not supported by this server: {instead}"
    return None


def _refused_do_sample(do_sample: Any, temperature: Any, greedy_only: bool) -> str | None:
    """Why ``do_sample`` is refused beside ``temperature``; None where they agree, or where the
    temperature itself is wrong (its own error says so, not this one)."""
    if greedy_only:
        return None if do_sample is False else "'do_sample': this endpoint answers greedily: leave it out"
    if temperature is None:
        temperature = 0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        return None
    if temperature != 0 and not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        return None
    if do_sample is (temperature > 0):
        return None
    return (
        f"'do_sample' {json.dumps(do_sample)} disagrees with 'temperature' {temperature!r}, which decides on this"
        " server (0 or left out: greedy; above 0: sampling): leave do_sample out"
    )

"""How each token is chosen: greedy or sampled, at the root and at every node of a verified tree.

Drafts are proposals, not samples from a draft model: a draft only decides which draws one
forward can check, so sampling needs no rejection correction (a drafter must only leave torch's
generators alone, see ``drafter``). Walk the verified tree from the root: at each node turn its
logits into the target distribution with transformers' own logits processors (the ones
``model.generate`` would build: repetition penalty, then temperature, top-k, top-p, min-p),
draw one token, and descend into the child drafted with that token if there is one;
otherwise the draw is the step's bonus token. Every
emitted token costs exactly one draw, in order, from the same distribution plain sampling
uses, so the output is an ancestral sample of the model, and with the same generator state
it is the same sample token for token.

Worked example: the root's draft children are ``A`` and ``B``, ``A`` has a child ``C``. The
root's distribution draws ``A`` (a drafted child: descend), ``A``'s node draws ``D`` (not
drafted): the step emits ``A D``. Had it drawn ``C``, the walk would continue at ``C``'s node.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from numbers import Integral, Real
from typing import Any

import torch

from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.errors import ConfigError
from rag_lookahead.greedy_head import SCREEN_WIDTH

#: the lowest sampling temperature: below it the scaled logits overflow to inf (1e-300 failed a
#: whole server batch); 1e-5 keeps float32 logits of |100| finite, and samples like greedy anyway
MIN_TEMPERATURE = 1e-5
#: the lowest repetition penalty to sample with: a seen token's positive logit is divided by it
#: (then by the temperature), and 1e-300 made it inf and the draw NaN (a server 500); at 1e-6
#: float32 logits of |1000| stay finite down to MIN_TEMPERATURE
MIN_REPETITION_PENALTY = 1e-6


class _Unset:
    """A keyword the caller did not give. None is a value: ``model.generate(top_k=None)`` turns
    top-k off (and ``do_sample=None`` sampling), where leaving it out keeps the model's setting."""

    def __repr__(self) -> str:
        return "UNSET"


#: the default of ``generate``'s sampling keywords: not given, so the model's setting holds
UNSET: Any = _Unset()

#: generation options that change the output and that we do not implement, with their neutral
#: values; a value other than these raises instead of being silently ignored
UNSUPPORTED_NEUTRAL = {
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "num_return_sequences": (None, 1),
    "penalty_alpha": (None, 0, 0.0),  # contrastive search needs it above 0
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "encoder_repetition_penalty": (None, 1.0),
    "bad_words_ids": (None,),
    "force_words_ids": (None,),
    "constraints": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "guidance_scale": (None, 1.0),
    "sequence_bias": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "suppress_tokens": (None, []),  # an empty list suppresses nothing in transformers too
    "begin_suppress_tokens": (None, []),
    "exponential_decay_length_penalty": (None,),
    "renormalize_logits": (None, False),
    "remove_invalid_values": (None, False),
    "watermarking_config": (None,),
    "diversity_penalty": (None, 0.0),
    "dola_layers": (None,),
    "stop_strings": (None,),
    "max_time": (None,),
    "token_healing": (None, False),
}
#: warpers transformers applies only when sampling (and a renormalisation that keeps the argmax):
#: greedy decoding ignores them there, so it does here
_GREEDY_IGNORES = frozenset({"typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "renormalize_logits"})

#: GenerationConfig switches that ask for per-step tensors we do not produce (``model.generate``
#: ignores them without ``return_dict_in_generate``)
PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


#: SamplingParams fields whose None means 1.0, their "off"
_NEUTRAL_WHEN_NONE = ("temperature", "top_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """What turns a row's logits into its next token (names and meanings as in ``model.generate``).

    do_sample: False picks the most likely token (after the repetition penalty, if any).
    temperature, top_k, top_p, min_p: the sampling warpers; top_k 0/None, top_p 1.0 and min_p
        None are off.
    repetition_penalty: applied exactly at each tree node over the row's tokens and the node's path.
    None for temperature, top_p or repetition_penalty is their neutral 1.0 (off), as in
    ``resolve_sampling`` and transformers: ``top_p=None`` was taken, then failed at the first
    sampled step with "'<' not supported between 'NoneType' and 'float'".
    seed: None draws from torch's global generator (the order transformers draws in); an int
        gives the row a generator of its own, so its tokens depend on nothing else in the batch.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in _NEUTRAL_WHEN_NONE:
            if getattr(self, name) is None:
                object.__setattr__(self, name, 1.0)
        if not isinstance(self.do_sample, bool):
            raise ConfigError(f"do_sample must be True or False, got {self.do_sample!r}")
        _number("temperature", self.temperature, low=0.0, high=math.inf, open_low=True)
        if self.do_sample and self.temperature < MIN_TEMPERATURE:  # logits / 1e-300 are inf: no distribution
            raise ConfigError(f"temperature must be at least {MIN_TEMPERATURE:g} to sample, got {self.temperature!r}")
        check_warpers(top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)
        _number("repetition_penalty", self.repetition_penalty, low=0.0, high=math.inf, open_low=True)
        if self.do_sample and self.repetition_penalty < MIN_REPETITION_PENALTY:
            least = f"{MIN_REPETITION_PENALTY:g}"
            raise ConfigError(f"repetition_penalty must be at least {least} to sample, got {self.repetition_penalty!r}")
        check_seed(self.seed)
        if self.seed is not None:  # torch.Generator.manual_seed takes a Python int, not numpy's
            object.__setattr__(self, "seed", int(self.seed))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def plain(self) -> bool:
        """Greedy with nothing to apply: the argmax of the raw logits."""
        return not self.do_sample and self.repetition_penalty == 1.0


def check_warpers(*, top_p=None, min_p=None, top_k=None) -> None:
    """The ranges of the sampling warpers that are given (None: not given). Greedy decoding ignores
    their values, but a setting kept for later calls is judged when it is made, not at the first
    call that samples with it."""
    if top_p is not None:
        _number("top_p", top_p, low=0.0, high=1.0)  # 0 keeps one token, as in transformers
    if min_p is not None:
        _number("min_p", min_p, low=0.0, high=1.0)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 0):
        raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")


def check_seed(seed) -> None:
    """None, or an integer a torch generator takes (ConfigError otherwise)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= seed < 2**63):
        raise ConfigError(f"seed must be an integer from 0 to 2**63-1, got {seed!r}")


def _number(name: str, value, *, low: float, high: float, open_low: bool = False) -> None:
    ok = (
        isinstance(value, Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value <= high
        and (value > low if open_low else value >= low)
    )
    if not ok:
        bound = f"> {low}" if open_low else f">= {low}"
        upper = f" and <= {high}" if math.isfinite(high) else " and finite"
        raise ConfigError(f"{name} must be a number {bound}{upper}, got {value!r}")


def resolve_sampling(
    model, generation_config=None, *, prompt_width: int | None = None, has_eos: bool = True, **options
) -> SamplingParams:
    """The sampling settings ``model.generate`` would use for the same arguments.

    Precedence as in transformers: explicit options, then ``generation_config``, then the
    model's own ``generation_config``, then transformers' defaults (e.g. top_k 50 when
    sampling). Options left at :data:`UNSET` are not given; an explicit None is transformers'
    "off" (no top-k, no sampling). Greedy decoding ignores the sampling warpers' values, as
    transformers does (``temperature=0.0`` with ``do_sample=False`` is greedy, not an error).
    Settings we do not implement raise ``ConfigError`` rather than being ignored (``prompt_width``,
    ``has_eos``: see ``check_supported``).
    """
    from transformers import GenerationConfig

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ConfigError(
            f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}"
        )
    if generation_config is not None:
        refuse_per_step_outputs(generation_config)
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    # a config model.generate prepared (it set ``_eos_token_tensor``, as for a custom_generate) is final:
    # transformers already applied the model's and its global defaults, and a None left in it is an
    # explicit "off" (do_sample=None: greedy, top_k=None: no top-k) that must not be refilled
    prepared = hasattr(config, "_eos_token_tensor")
    own = getattr(model, "generation_config", None)
    if own is not None and not prepared:
        config.update(**own.to_dict(), defaults_only=True)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None and not prepared:
        config.update(**defaults(), defaults_only=True)
    given = {k: v for k, v in options.items() if v is not UNSET}
    try:
        unknown = config.update(**given)
    except ValueError as err:  # transformers' own validation
        raise ConfigError(f"invalid generation options: {err}") from None
    if unknown:
        raise ConfigError(f"unknown generation options: {', '.join(sorted(unknown))}")
    check_supported(config, prompt_width, has_eos)
    penalty = float(config.repetition_penalty if config.repetition_penalty is not None else 1.0)
    if not config.do_sample:  # the warpers are not applied: their values are not ours to refuse
        return SamplingParams(repetition_penalty=penalty)
    top_k = config.top_k if config.top_k else None
    return SamplingParams(
        do_sample=bool(config.do_sample),
        temperature=float(config.temperature if config.temperature is not None else 1.0),
        top_k=top_k,  # checked as an integer there (int() cut a per-call 1.5 to 1)
        top_p=float(config.top_p if config.top_p is not None else 1.0),
        min_p=float(config.min_p) if config.min_p is not None else None,
        repetition_penalty=penalty,
    )


def check_supported(config, prompt_width: int | None = None, has_eos: bool = True) -> None:
    """Refuse generation options that would change the output and that we do not implement.

    ``min_length`` and ``min_new_tokens`` only hold EOS back, so they change nothing without EOS
    ids (transformers then adds no processor for them), and ``min_length`` nothing at or below the
    prompt's (padded) width, which is what transformers makes of ``min_new_tokens=0``."""
    for name, neutral in UNSUPPORTED_NEUTRAL.items():
        value = getattr(config, name, None)
        if name in ("min_length", "min_new_tokens") and _holds_nothing_back(name, value, prompt_width, has_eos):
            continue
        if name in _GREEDY_IGNORES and not config.do_sample:
            continue
        if value not in neutral:
            asked = getattr(config, "min_new_tokens", None) if name == "min_length" else None
            origin = f" (what transformers makes of min_new_tokens={asked!r})" if asked not in (None, 0) else ""
            if name == "min_length" and not origin and prompt_width is not None:  # say what would be served
                origin = f" for a prompt of {prompt_width} tokens (a prompt of {value!r} or more holds nothing back)"
            raise ConfigError(f"generation option {name}={value!r}{origin} is not supported by lookahead decoding")
    if getattr(config, "cache_implementation", None) == "quantized":  # its keys and values are rounded
        raise ConfigError(
            "cache_implementation='quantized' changes the tokens (the cache's keys and values are rounded), and"
            " lookahead decoding keeps a full-precision cache: drop it to get the model's own tokens"
        )
    refuse_assisted_sampling(config)


def refuse_per_step_outputs(config) -> None:
    """Refuse a config that asks for per-step tensors in a dict (``output_scores`` and
    ``return_dict_in_generate``...): we return sequences and stats only. Checked on the config a
    caller hands in (or transformers prepared for ``hf_generate``), not on the model's own: there
    it only shapes what ``model.generate`` returns, which our ``generate`` never returns, and it
    made every call on such a model a ConfigError."""
    asked = [name for name in PER_STEP_OUTPUTS if getattr(config, name, False)]
    if asked and getattr(config, "return_dict_in_generate", False):
        raise ConfigError(
            f"{', '.join(f'{name}=True' for name in asked)} with return_dict_in_generate is not supported by"
            " lookahead decoding (sequences and stats only; rag_lookahead.generate(..., logprobs=k) records"
            " each new token's log-probability)"
        )


def refuse_assisted_sampling(config, assistant_model=None) -> None:
    """Refuse sampling in transformers' assisted-generation mode (an ``assistant_model``, or
    ``prompt_lookup_num_tokens``, ``assistant_early_exit``, ``use_mtp`` in the config, the
    model's own included): ``model.generate`` then samples through its assisted decoding, whose
    draws differ from plain sampling's; greedy assisted decoding gives greedy's tokens, unless an
    ``assistant_ensemble_weight`` makes it accept the argmax of a mix of the two models' probabilities."""
    from transformers.generation.configuration_utils import GenerationMode

    if config.get_generation_mode(assistant_model) != GenerationMode.ASSISTED_GENERATION:
        return
    if getattr(config, "assistant_ensemble_weight", None) is not None:
        raise ConfigError(
            "assistant_ensemble_weight makes assisted generation accept the argmax of a mix of the model's and"
            " the assistant's probabilities, not the model's own tokens, and lookahead decoding gives the model's"
            " own tokens only: drop it and the assisted-generation argument (lookahead drafts on its own)"
        )
    if config.do_sample:
        raise ConfigError(
            "assisted generation (assistant_model, prompt_lookup_num_tokens, assistant_early_exit, use_mtp) with"
            " do_sample=True draws other tokens than plain sampling under the same torch.manual_seed, and"
            " lookahead decoding reproduces plain sampling only: drop the assisted-generation argument"
            " (lookahead drafts on its own)"
        )


def _holds_nothing_back(name: str, value, prompt_width: int | None, has_eos: bool) -> bool:
    if not has_eos:
        return True
    if not isinstance(value, Integral):
        return False
    if name == "min_new_tokens":
        return value <= 0
    return prompt_width is not None and value <= prompt_width


def per_row(params: SamplingParams, seed: int | Sequence[int] | None, rows: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per row: an int seed is every row's, a list (or a numpy array or a
    tensor of one per row, as ``max_new_tokens`` takes them) gives one per row."""
    if getattr(seed, "ndim", None) in (0, 1):  # numpy or torch values
        seed = seed.tolist()
    elif isinstance(seed, Sequence) and not isinstance(seed, (str, bytes)):
        seed = [s.item() if getattr(s, "ndim", None) == 0 else s for s in seed]  # 0-d tensors in a list
    if seed is None or isinstance(seed, Integral):
        return [replace(params, seed=seed)] * rows
    if isinstance(seed, (str, bytes)) or not isinstance(seed, Sequence) or len(seed) != rows:
        raise ConfigError(f"seed must be an int or a list of {rows} ints (one per row), got {seed!r}")
    return [replace(params, seed=s) for s in seed]


def build_processors(params: SamplingParams):
    """transformers' own processors, in the order ``model.generate`` applies them."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.do_sample:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
        if params.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=params.min_p, min_tokens_to_keep=1))
    return processors


@dataclass
class Accepted:
    """One row's outcome of a verify step."""

    nodes: list[int]  # accepted draft node indices, root to leaf
    tokens: list[int]  # their tokens followed by the bonus token
    stopped: bool = False  # the chooser's ``stop_after`` ended the row at the last token


class TokenChooser:
    """One row's rule for picking tokens from logits: its processors and its random generator.

    ``stop_after(tokens)``: optional; told the tokens chosen so far this step (each one, the step's
    last and a row's first included), True ends the row after the last of them. For a caller's own
    stopping rule (transformers' stopping criteria): a sampled row must stop drawing where the rule
    stops it, or the draws spent on tokens cut afterwards leave the random generator where
    ``model.generate`` would not. A plain greedy row, which draws nothing, is asked the same way
    once its path is found (``cut_at_stop``)."""

    def __init__(self, params: SamplingParams, device) -> None:
        self.params = params
        self.processors = build_processors(params)
        self.stop_after: Callable[[list[int]], bool] | None = None
        self.generator = None
        if params.do_sample and params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    @property
    def plain(self) -> bool:
        return self.params.plain

    def stops(self, tokens: list[int]) -> bool:
        """Whether ``stop_after`` ends the row after ``tokens`` (this step's so far)."""
        return self.stop_after is not None and bool(self.stop_after(tokens))

    def cut_at_stop(self, path: Accepted, limit: int, eos: frozenset[int]) -> Accepted:
        """A plain greedy row's path (found without a walk) cut where ``stop_after`` ends the row,
        asked token by token as a walk asks: up to ``limit`` tokens, none after EOS."""
        if self.stop_after is None:
            return path
        for i, token in enumerate(path.tokens[: max(limit, 1)]):
            if self.stops(path.tokens[: i + 1]):
                return Accepted(path.nodes[:i], path.tokens[: i + 1], stopped=True)
            if token in eos:
                break
        return path

    def choose(self, history: Sequence[int], logits: torch.Tensor) -> int:
        """The next token after ``history`` given its logits (V,), drawn as ``model.generate`` draws."""
        scores = logits.to(dtype=torch.float32)[None]
        if self.processors:
            ids = torch.tensor([list(history)], dtype=torch.long, device=logits.device)
            scores = self.processors(ids, scores)
        if self.params.do_sample:
            probs = torch.softmax(scores, dim=-1)
            return int(torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0])
        return int(scores.argmax(dim=-1)[0])

    def walk(
        self, draft: DraftTree, logits: torch.Tensor, history: Sequence[int], limit: int, eos: frozenset[int]
    ) -> Accepted:
        """Choose down the tree; ``logits[i]`` is node i-1's (0: the root). At most ``limit`` tokens,
        and none after EOS or where ``stop_after`` says stop (asked after every token, the last
        too: ``Accepted.stopped`` ends the row), so no draw is spent on a token that would be cut."""
        children = draft.children()
        path = list(history)
        nodes: list[int] = []
        tokens: list[int] = []
        current = -1
        while len(tokens) < max(limit, 1):
            token = self.choose(path, logits[current + 1])
            tokens.append(token)
            if self.stops(tokens):
                return Accepted(nodes, tokens, stopped=True)
            child = children.get((current, token))
            if child is None or token in eos:
                break
            nodes.append(child)
            path.append(token)
            current = child
        return Accepted(nodes, tokens)


def longest_paths(drafts: Sequence[DraftTree], greedy: Sequence[int], starts: Sequence[int]) -> list[Accepted]:
    """Follow greedy choices down each row's tree: row r's ``greedy[starts[r] + i]`` is for its
    node i-1 (0: its root); each row's accepted nodes and tokens (the bonus token last).

    Where ``greedy`` computes tokens when read (the screened output layer's ``GreedyTokens``), a
    single row is walked level by level; a level whose position is not screened yet is asked for
    together with the likeliest nodes below it (one small product), so positions off the accepted
    path are rarely computed. (Refilling the line at every level made each level below the first
    product a product of one position: ~14 products a step on copied English answers, ~7.6 ms
    each, against ~3.) Several rows ask for every position at once: walked by level, 32 rows paid ~8
    small products a step on top of the first (12.7 ms each here) and their steps got no
    cheaper (copying set, 32 rows, fp32).
    """
    children = [draft.children() for draft in drafts]
    paths = [Accepted([], []) for _ in drafts]
    current = [-1] * len(drafts)
    walking = list(range(len(drafts)))
    prefetch = getattr(greedy, "prefetch", None)
    if prefetch is not None and len(drafts) > 1:  # several rows: every position in one product, then read
        prefetch(range(len(greedy)))
    single = prefetch is not None and len(drafts) == 1
    likeliest = _likeliest_children(drafts[0]) if single else {}
    while walking:
        wanted = [starts[r] + current[r] + 1 for r in walking]
        if single and not greedy.screened(wanted[0]):  # it and the likeliest line below: nearly free together
            prefetch(wanted + _likeliest_line(likeliest, current[0], starts[0], SCREEN_WIDTH - 1))
        still = []
        for r, position in zip(walking, wanted):
            choice = greedy[position]
            paths[r].tokens.append(choice)
            nxt = children[r].get((current[r], choice))
            if nxt is not None:
                paths[r].nodes.append(nxt)
                current[r] = nxt
                still.append(r)
        walking = still
    return paths


def _likeliest_children(draft: DraftTree) -> dict[int, int]:
    """Each node's likeliest child (-1: the root's), by the drafter's estimate."""
    best: dict[int, int] = {}
    for node, (parent, prob) in enumerate(zip(draft.parents, draft.probs)):
        if parent not in best or prob > draft.probs[best[parent]]:
            best[parent] = node
    return best


def _likeliest_line(likeliest: dict[int, int], node: int, start: int, room: int) -> list[int]:
    """Up to ``room`` positions below ``node``, each the likeliest child of the one before."""
    line: list[int] = []
    while len(line) < room and (node := likeliest.get(node)) is not None:
        line.append(start + node + 1)
    return line

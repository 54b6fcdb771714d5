"""One profile per model holds what the loop measured about it: readable, and forgotten on reset."""

from __future__ import annotations

from tiny_models import build_tiny_model

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.profile import ModelProfile, profile_of


def test_a_model_profile_fills_as_the_loop_learns_and_empties_on_reset():
    model = build_tiny_model("qwen2", seed=7)
    profile = profile_of(model)
    assert isinstance(profile, ModelProfile) and profile_of(model) is profile
    assert profile.as_dict() == {
        "tree_mask": None,
        "tree_mask_reason": None,
        "position_origin": None,
        "cost_curve": None,
        "step_costs_seen": None,
        "output_pools": [],
        "drafts_met": {},
    }
    generate(model, [1, 2, 3, 1, 2], max_new_tokens=4, config=LookaheadConfig(budget="fixed"))
    assert profile.tree_mask is True and profile.cost_curve is None  # a fixed budget measures nothing
    assert profile.position_origin == 0
    generate(model, [1, 2, 3, 1, 2], max_new_tokens=4)  # the auto budget measures the curve once
    summary = profile.as_dict()
    assert summary["tree_mask"] is True and sorted(summary["cost_curve"]) == profile.cost_curve.sizes
    depth = LookaheadConfig().branch_length + LookaheadConfig().max_key_length  # the default pool's depth
    nodes = LookaheadConfig().output_pool_nodes
    assert summary["step_costs_seen"] >= 1 and summary["output_pools"][0]["depth"] == depth
    assert summary["output_pools"][0]["max_nodes"] == nodes and summary["output_pools"][0]["nodes"] > 0
    assert f"OutputPool(depth={depth}" in repr(profile)
    assert summary["drafts_met"]["TrieDrafter"].startswith("AcceptanceRates(")
    profile.reset()
    assert profile.as_dict()["tree_mask"] is None and profile.output_pools == {} and profile.step_costs is None
    assert profile.drafts_met == {} and profile.position_origin is None


def test_a_new_call_starts_from_what_earlier_calls_drafts_met():
    from rag_lookahead.decoding.decode_batch import DecodeBatch
    from rag_lookahead.decoding.drafter import PromptLookupDrafter

    model = build_tiny_model("qwen2", seed=9)
    config = LookaheadConfig(budget="fixed")
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    assert generate(model, prompt, max_new_tokens=12, config=config).stats.draft_tokens > 0
    met = profile_of(model).drafts_met["TrieDrafter"]
    assert met._first[1] > 1.0  # more drafted first tokens counted than the trusting start's one
    batch = DecodeBatch(model, config, frozenset(), None)
    assert batch.workload is met  # the next call's rows start from it
    other = DecodeBatch(model, config, frozenset(), None, drafter=PromptLookupDrafter())
    assert other.workload is not met and set(profile_of(model).drafts_met) == {"TrieDrafter", "PromptLookupDrafter"}


def test_output_pools_are_shared_per_trie_depth_and_node_cap():
    model = build_tiny_model("qwen2", seed=8)
    shallow, deep = LookaheadConfig(budget="fixed", branch_length=4), LookaheadConfig(budget="fixed")
    generate(model, [5, 6, 7], max_new_tokens=6, config=shallow)
    generate(model, [5, 6, 7], max_new_tokens=6, config=deep)
    generate(model, [5, 6, 8], max_new_tokens=6, config=deep)
    pools = profile_of(model).output_pools
    d, cap = deep.branch_length + deep.max_key_length, deep.output_pool_nodes
    assert sorted(pools) == [(8, cap), (d, cap)] and pools[(8, cap)].depth == 8 and pools[(d, cap)].depth == d
    assert profile_of(model).output_pool(d, cap) is pools[(d, cap)]
    # a call with its own cap writes to a pool bounded by it, not to the default-capped one
    small = LookaheadConfig(budget="fixed", output_pool_nodes=50)
    generate(model, list(range(3, 60)), max_new_tokens=40, config=small)
    assert pools[(d, 50)].max_nodes == 50 and pools[(d, 50)].nodes <= 50


def test_a_tree_mask_verdict_set_by_hand_is_kept_and_one_from_other_attention_is_probed_again():
    """``tree_mask`` set by hand (no ``tree_mask_attention``) is the verdict under any attention: no
    probe forward overrides it; one reached under another attention is probed again."""
    from rag_lookahead.decoding.verify import supports_tree_mask

    model = build_tiny_model("qwen2", seed=7)
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    profile = profile_of(model)
    profile.tree_mask = False
    assert supports_tree_mask(model) is False and forwards == []
    assert profile.tree_mask is False and profile.tree_mask_attention is None
    profile.tree_mask_attention = "flex_attention"  # reached under flex, the model now runs sdpa
    assert supports_tree_mask(model) is True and forwards  # the probe ran: this tiny model takes tree masks
    assert profile.tree_mask_attention == "sdpa"

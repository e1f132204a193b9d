"""Lookahead decoding: the window mask, the Jacobi update rule, losslessness, bounded pools, knobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.errors import ConfigError
from specfree.masks.jacobi import window_block
from specfree.masks.tree import build_layout
from specfree.plugins import build_plugin_manager, registry
from specfree.pools.lru import LRUNGramPool
from specfree.strategies.base import Outcome
from specfree.strategies.lookahead import LOOKAHEAD_DEFAULTS, Lookahead, lookahead
from specfree.draft_tree import merge
from specfree.types import Verdict
from tests._lookahead_models import FAMILIES, VOCAB, plain_greedy, tiny


pytestmark = pytest.mark.usefixtures("one_thread")


FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODEL = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- the mask --------------------------------------------------------------------------------

def reference_window_mask(columns: int, levels: int) -> tuple[np.ndarray, list[int]]:
    """[1+A, 1+A] visibility over (root + window rows) and offsets, built the way the reference
    implementation (lade ``j_make_causal_mask_multilevel``) does: a causal block over the root
    and level 0, then for each further level the same lower triangle over [root + level 0] and
    a diagonal onto every earlier level (>= 1) and itself."""
    size = columns  # the reference's tiny_mask_size: root + level 0
    q = size * levels
    mask = np.zeros((q, q), dtype=bool)
    tri = np.tril(np.ones((size, size), dtype=bool))
    for ll in range(levels):
        mask[size * ll : size * (ll + 1), :size] |= tri
        for row in range(1, ll + 1):
            mask[size * ll : size * (ll + 1), size * row : size * (row + 1)] |= np.eye(size, dtype=bool)
    offsets = [0] + list(range(1, size)) + [ll + i for ll in range(1, levels) for i in range(size)]
    return mask, offsets


@FAST
@given(columns=st.integers(1, 12), levels=st.integers(1, 7))
def test_window_mask_matches_reference_construction(columns, levels):
    block = window_block(columns, levels)
    mask, offsets = reference_window_mask(columns, levels)
    assert block.attends.dtype == torch.bool
    assert np.array_equal(block.attends.numpy(), mask[1:, 1:])
    assert mask[1:, 0].all()  # every window row sees the root (sees_root=True)
    assert block.offsets == offsets[1:]
    # Each row reads one token per position root+0 .. root+offset: a consistent sequence.
    for i, off in enumerate(block.offsets):
        seen = [0] + [block.offsets[k] for k in np.flatnonzero(block.attends[i].numpy())]
        assert sorted(seen) == list(range(off + 1))


@FAST
@given(window=st.integers(1, 6), ngram=st.integers(2, 5), guesses=st.integers(1, 7), data=st.data())
def test_step_layout_keeps_tree_and_window_apart(window, ngram, guesses, data):
    """Full step mask == naive construction: the tree sees its ancestors, the window its own cells,
    both see the root; positions are root + depth / root + offset."""
    levels = data.draw(st.integers(1, ngram - 1))
    columns = window + ngram - 1 - levels
    cands = data.draw(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=ngram - 1), max_size=guesses))
    tree = merge(7, ((c, "lookahead") for c in cands), budget=1000)
    block = window_block(columns, levels)
    from specfree.types import AuxBlock
    aux = AuxBlock(list(range(len(block))), block.offsets, block.attends, sees_root=True)
    root_pos = data.draw(st.integers(0, 50))
    layout = build_layout(tree, aux, root_position=root_pos)
    t, q = len(tree), len(tree) + len(block)
    naive = np.zeros((q, q), dtype=bool)
    for i in range(t):
        j = i
        while j >= 0:
            naive[i, j] = True
            j = tree.parents[j]
    win, _ = reference_window_mask(columns, levels)
    naive[t:, 0] = True
    naive[t:, t:] = win[1:, 1:]
    assert np.array_equal(layout.allowed.numpy(), naive)
    expected_pos = [root_pos + d for d in tree.depths] + [root_pos + o for o in block.offsets]
    assert layout.positions.tolist() == expected_pos


# ---- the Jacobi update rule, against the reference implementation's bookkeeping ----------------

class RecordingPool:
    """A pool that remembers what it was given and drafts nothing."""

    def __init__(self, key_len: int = 1):
        self.key_len = key_len
        self.added: list[tuple] = []

    def add(self, key, cont):
        key = int(key[0]) if self.key_len == 1 else tuple(int(t) for t in key)
        self.added.append((key, tuple(int(t) for t in cont)))

    def update(self, tokens, *, source="output"):
        pass

    def lookup(self, context, max_nodes, max_depth):
        return []

    def begin_request(self, prompt):
        pass

    def end_request(self):
        pass

    def __len__(self):
        return len(self.added)


def reference_run(init: list[int], roots: list[int], outputs: list[list[int]], window: int, ngram: int):
    """lade's ``past_tokens`` bookkeeping (ALWAYS_FWD_ONE), step by step: window tokens, offsets
    and the n-grams ``update_token_map`` stores."""
    level = ngram
    past = [list(init)] + [None] * (level - 2)
    fill, steps, added = 0, [], []
    for root, out in zip(roots, outputs):
        tokens, offsets = [], []
        for ll in range(fill + 1):
            tokens += past[ll]
            offsets += list(range(1 if ll == 0 else ll, (1 if ll == 0 else ll) + len(past[ll])))
        steps.append((tokens, offsets))
        new = out[-len(past[fill]):]  # argmax of the newest level's rows
        if past[1] is None:
            past[0] = past[0][1:]
            past[1] = new
            fill += 1
        elif past[level - 2] is None:
            for ll in range(fill + 1):
                past[ll] = past[ll][1:]
            past[fill + 1] = new[1:]
            fill += 1
        else:
            added.append((root, tuple(past[ll][0] for ll in range(1, level - 1)) + (new[0],)))
            for i in range(1, window):
                added.append((past[0][i - 1], tuple(past[ll][i] for ll in range(1, level - 1)) + (new[i],)))
            past[0] = past[1][1:]
            for ll in range(1, level - 2):
                past[ll] = past[ll + 1][:]
            past[level - 2] = new
    return steps, added


@FAST
@given(window=st.integers(1, 6), ngram=st.integers(3, 6), steps=st.integers(1, 9), seed=st.integers(0, 1000))
def test_window_update_follows_reference_implementation(window, ngram, steps, seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 50, size=int(rng.integers(1, 30)))
    strategy = Lookahead(RecordingPool(), window=window, ngram=ngram, guesses=2, init="random", init_seed=seed,
                         idle_every=1)
    strategy.setup(VOCAB, 10_000)
    strategy.begin(prompt)
    init = strategy.grid[0, 1:].tolist()
    context = list(prompt)
    roots, outputs, seen = [], [], []
    for _ in range(steps):
        proposal = strategy.propose(np.array(context), max_depth=100)
        aux = proposal.aux
        seen.append((aux.tokens, aux.offsets))
        assert aux.attends.shape == (len(aux), len(aux))
        out = rng.integers(0, VOCAB, size=len(aux)).tolist()  # what the model "predicts" per row
        logits = torch.nn.functional.one_hot(torch.tensor(out), VOCAB).float()
        roots.append(context[-1])
        outputs.append(out)
        emitted = int(rng.integers(0, VOCAB))
        tree = merge(context[-1], [], budget=10)
        context.append(emitted)
        strategy.observe(Outcome(tree, Verdict([emitted], []), np.array(context), logits))
    ref_steps, ref_added = reference_run(init, roots, outputs, window, ngram)
    assert seen == ref_steps
    assert strategy.pool.added == ref_added
    if steps > ngram - 2:  # warm: (ngram-1) levels of `window` columns, minus the root
        assert len(seen[-1][0]) == (ngram - 1) * window - 1


def test_bigram_window_harvests_the_model_s_own_chains():
    """ngram=2 is plain Jacobi decoding: each harvested pair is (cell, argmax at that cell)."""
    strategy = Lookahead(RecordingPool(), window=4, ngram=2, guesses=1, idle_every=1)
    strategy.setup(VOCAB, 100)
    strategy.begin(np.array([5, 6, 7, 8, 9]))
    context = [5, 6, 7, 8, 9]
    proposal = strategy.propose(np.array(context), 10)
    assert proposal.aux.tokens == [7, 8, 9] and proposal.aux.offsets == [1, 2, 3]
    logits = torch.nn.functional.one_hot(torch.tensor([20, 21, 22]), VOCAB).float()
    context.append(11)
    strategy.observe(Outcome(merge(9, [], 1), Verdict([11], []), np.array(context), logits))
    assert strategy.pool.added == [(7, (20,)), (8, (21,)), (9, (22,))]
    assert strategy.propose(np.array(context), 10).aux.tokens == [20, 21, 22]


def test_two_token_keys_end_at_each_column_s_first_level_cell():
    strategy = Lookahead(RecordingPool(key_len=2), window=3, ngram=3, guesses=1, idle_every=1)
    strategy.setup(VOCAB, 100)
    strategy.begin(np.array([5, 6, 7, 8, 9]))  # level 0 after the root: [7, 8, 9] ("recent")
    context = [5, 6, 7, 8, 9]
    for step, emitted in enumerate([11, 12]):
        aux = strategy.propose(np.array(context), 10).aux
        logits = torch.nn.functional.one_hot(torch.arange(30, 30 + len(aux)), VOCAB).float()
        context.append(emitted)
        strategy.observe(Outcome(merge(context[-2], [], 1), Verdict([emitted], []), np.array(context), logits))
    # Step 0 (warm-up): level 1 = argmaxes [30, 31, 32]; every level drops column 0.
    # Step 1 (warm): level 0 = [root 11, 8, 9], level 1 = [30, 31, 32], newest = [32, 33, 34];
    # column j is keyed by (the token before its first-level cell, that cell).
    first_level = [11] + aux.tokens[: 2]
    newest = list(range(30 + 2, 30 + 5))
    assert strategy.pool.added == [((9, 11), (aux.tokens[2], newest[0])),
                                   ((11, first_level[1]), (aux.tokens[3], newest[1])),
                                   ((first_level[1], first_level[2]), (aux.tokens[4], newest[2]))]


def test_idle_steps_can_skip_the_window():
    model = tiny("llama")
    prompt = [5, 6, 7, 8, 9, 10]
    engine = Engine.from_model(model, None, "lookahead", window=3, ngram=3, guesses=2, idle_every=0,
                               pool_from_prompt=False, priced=False)  # the window's own rule, not the pricer's
    result = engine.generate(prompt, 30, ignore_eos=True)
    assert result.tokens == plain_greedy(model, prompt, 30)
    for step in result.steps:
        assert (step.extra["window"] > 0) == (step.extra["candidates"] > 0)
        if step.extra["candidates"] == 0:
            assert step.rows == 1


# ---- losslessness -----------------------------------------------------------------------------

@st.composite
def prompts(draw) -> list[int]:
    """Repetitive prompts (so prompt n-grams hit) with some noise."""
    token = st.integers(3, VOCAB - 1)
    pattern = draw(st.lists(token, min_size=1, max_size=5))
    noise = draw(st.lists(token, max_size=5))
    return (pattern * draw(st.integers(1, 5)) + noise)[:40]


knobs = st.fixed_dictionaries(dict(
    window=st.integers(1, 6), ngram=st.integers(2, 5), guesses=st.one_of(st.integers(1, 7), st.none()),
    init=st.sampled_from(["random", "recent"]), pool_from_prompt=st.booleans(), add_output=st.booleans(),
    init_seed=st.integers(0, 9), idle_every=st.integers(0, 3))).filter(
    lambda k: k["idle_every"] > 0 or k["pool_from_prompt"] or k["add_output"])


@MODEL
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), knobs=knobs, max_new=st.integers(1, 48))
def test_greedy_output_equals_plain_greedy(family, prompt, knobs, max_new):
    model = tiny(family)
    result = Engine.from_model(model, None, "lookahead", **knobs).generate(prompt, max_new, ignore_eos=True)
    assert result.tokens == plain_greedy(model, prompt, max_new)
    assert sum(s.emitted for s in result.steps) == len(result.tokens)


@MODEL
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), knobs=knobs, seed=st.integers(0, 2**31),
       temperature=st.floats(0.5, 1.5), top_k=st.integers(0, 40), top_p=st.floats(0.6, 1.0))
def test_seeded_sampling_equals_autoregressive_sampling(family, prompt, knobs, seed, temperature, top_k, top_p):
    model = tiny(family)
    sampling = dict(do_sample=True, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p)
    fast = Engine.from_model(model, None, "lookahead", **knobs, **sampling).generate(prompt, 32, ignore_eos=True)
    plain = Engine.from_model(model, None, "autoregressive", **sampling).generate(prompt, 32, ignore_eos=True)
    assert fast.tokens == plain.tokens


def test_runs_to_the_end_of_the_model_context():
    """Near the context end the window no longer fits: it is skipped, output stays exact."""
    model = tiny("gpt2", context=48)  # learned positions: a row past the end would crash
    prompt = [5, 6, 7, 8] * 5
    result = Engine.from_model(model, None, "lookahead", window=6, ngram=5).generate(prompt, 100, ignore_eos=True)
    assert result.stop_reason == "context_length"
    assert result.tokens == plain_greedy(model, prompt, 48 - len(prompt))
    assert result.steps[-1].extra["window"] == 0


def test_trie_pool_is_lossless_too():
    model = tiny("llama")
    prompt = [9, 10, 11, 12] * 6
    result = Engine.from_model(model, None, "lookahead", pool={"name": "trie", "max_nodes": 500, "branch_length": 3,
                                                                   "max_query_length": 1}).generate(
        prompt, 40, ignore_eos=True)
    assert result.tokens == plain_greedy(model, prompt, 40)


def test_window_alone_finds_drafts_the_model_accepts():
    """No prompt or output n-grams: every accepted draft came from the Jacobi window."""
    model = tiny("llama")
    plain = Engine.from_model(model, None, "autoregressive").generate([5, 6, 7], 80, ignore_eos=True)
    engine = Engine.from_model(model, None, "lookahead", window=4, ngram=4, guesses=4,
                               pool_from_prompt=False, add_output=False, idle_every=1, priced=False)
    result = engine.generate([5, 6, 7], 80, ignore_eos=True)
    assert result.tokens == plain.tokens
    assert sum(s.accepted for s in result.steps) > 0
    assert len(result.steps) < len(plain.steps)


def test_stats_per_step():
    model = tiny("qwen2")
    result = Engine.from_model(model, None, "lookahead", window=3, ngram=4, guesses=2, idle_every=1,
                               priced=False).generate(
        [5, 6, 7, 8] * 4, 20, ignore_eos=True)
    warm = result.steps[5]
    assert warm.extra["window"] == 3 * 3 - 1 and warm.extra["levels"] == 3
    for step in result.steps:
        assert set(step.extra) >= {"window", "candidates", "accepted", "pool_size"}
        assert step.extra["candidates"] <= 2 and step.extra["accepted"] == step.accepted
        assert step.rows == 1 + step.drafted + step.extra["window"]


# ---- bounded memory ---------------------------------------------------------------------------

def test_pool_stays_within_its_caps_over_4000_tokens():
    model = tiny("llama", context=4200, seed=1)
    strategy = lookahead(window=3, ngram=3, guesses=2, pool_capacity=40, idle_every=1)
    engine = Engine.from_model(model, None, strategy, priced=False)  # every step runs the window
    sizes, produced = [], 0
    for chunk in engine.stream(list(range(3, 40)), 4000, ignore_eos=True):
        produced += len(chunk.tokens)
        sizes.append(len(strategy.pool))
        assert len(strategy.pool) <= 40 * 2
        assert len(strategy.pool.keys()) <= 40
        assert strategy.grid.size <= 3 * 2
    assert produced == 4000
    assert max(sizes) == 80  # the caps were reached, and held


# ---- knobs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("knobs, message", [
    (dict(window=0), "lookahead.window must be >= 1, got 0"),
    (dict(ngram=1), "lookahead.ngram must be >= 2, got 1"),
    (dict(guesses=0), "lookahead.guesses must be >= 1, or None for no limit, got 0"),
    (dict(window=2.5), "lookahead.window must be an integer"),
    (dict(init="zeros"), "lookahead.init must be one of ['random', 'recent'], got 'zeros'"),
    (dict(pool="bloom"), "lookahead.pool=bloom: unknown pool 'bloom'; available: lru, suffix_array, suffix_automaton, suffix_tree, trie"),
    (dict(pool="suffix_array"), "lookahead learns n-grams from its window into a pool that keeps them: use pool=lru"),
    (dict(pool_capacity=0), "lookahead.pool_capacity must be >= 1, or None for no limit"),
    (dict(idle_every=-1), "lookahead.idle_every must be >= 0, got -1"),
    (dict(idle_every=0, pool_from_prompt=False, add_output=False), "the window would never run"),
])
def test_bad_knobs_are_named(knobs, message):
    with pytest.raises(ConfigError) as err:
        Engine.from_model(tiny("llama"), None, "lookahead", **knobs)
    assert message in str(err.value)


def test_window_larger_than_the_context_is_refused():
    with pytest.raises(ConfigError, match=r"lookahead.window must be between 1 and 62 .* holds 64 tokens .* got 63"):
        Engine.from_model(tiny("llama", context=64), None, "lookahead", window=63, ngram=3)
    with pytest.raises(ConfigError, match=r"lookahead.ngram must be between 2 and 64 .* got 70"):
        Engine.from_model(tiny("llama", context=64), None, "lookahead", window=1, ngram=70)
    Engine.from_model(tiny("llama", context=64), None, "lookahead", window=62, ngram=3)  # the widest that fits


def test_pool_must_keep_long_enough_ngrams():
    with pytest.raises(ConfigError, match="lookahead.ngram=5 needs a pool that keeps 5-grams"):
        Lookahead(LRUNGramPool(ngram=3), window=2, ngram=5)


def test_registered_with_its_defaults():
    component = registry(build_plugin_manager(entry_points=False)).get("strategy", "lookahead")
    assert component.config == LOOKAHEAD_DEFAULTS
    import inspect
    defaults = {k: p.default for k, p in inspect.signature(lookahead).parameters.items()}
    assert defaults.pop("pool") is None  # a pool object: from the pool group, not a config knob
    assert defaults == LOOKAHEAD_DEFAULTS

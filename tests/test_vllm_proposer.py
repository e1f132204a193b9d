"""specfree's vLLM proposer, driven the way vLLM's runner drives it (rows, not request ids), without vLLM.

The end-to-end check against vLLM itself is tests/test_vllm.py (it needs vLLM's own environment).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specfree.errors import ConfigError
from specfree.integrations.vllm import SpecfreeProposer

K = 4


def vllm_config(specfree=None, max_num_seqs=8):
    """The few fields of vLLM's VllmConfig the proposer reads."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=256, get_vocab_size=lambda: 128),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        additional_config={} if specfree is None else {"specfree": specfree})


class Batch:
    """vLLM's persistent batch: token ids by row; rows are reused and condensed as requests come and go."""

    def __init__(self, rows=4, width=256):
        self.ids = np.zeros((rows, width), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int32)

    def put(self, row, tokens):
        self.ids[row, : len(tokens)] = tokens
        self.lengths[row] = len(tokens)

    def grow(self, row, tokens):
        n = self.lengths[row]
        self.ids[row, n: n + len(tokens)] = tokens
        self.lengths[row] = n + len(tokens)

    def context(self, row):
        return self.ids[row, : self.lengths[row]]


def propose(proposer, batch, sampled):
    return proposer.propose(sampled, batch.lengths[: len(sampled)], batch.ids)


REPEAT = [5, 6, 7, 8, 9, 10, 11, 12] * 3


def test_prompt_lookup_drafts_the_repeat_and_learns_what_was_accepted():
    proposer = SpecfreeProposer(vllm_config(["strategy=prompt_lookup"]))
    batch = Batch()
    batch.put(0, REPEAT + [5])
    (draft,) = propose(proposer, batch, [[5]])
    assert draft == [6, 7, 8, 9]
    drafter = proposer.drafters.rows[0]
    batch.grow(0, [6, 7, 30])  # vLLM accepted two drafts, then its own token
    (draft,) = propose(proposer, batch, [[6, 7, 30]])
    assert proposer.drafters.rows[0] is drafter
    rates = proposer.pricer.acceptance
    assert sum(c[0] for c in rates.counts.values()) == 2 and sum(c[1] for c in rates.counts.values()) == 1


def test_unpriced_drafts_the_first_candidate_as_proposed():
    proposer = SpecfreeProposer(vllm_config(["strategy=prompt_lookup", "strategy.priced=false",
                                             "strategy.num_candidates=2"]))
    assert proposer.pricer is None
    batch = Batch()
    batch.put(0, [5, 6, 7, 8, 5, 6, 9, 9, 5])  # "5" is followed by "6 7 8 ..." and, more recently, "6 9 9 ..."
    (draft,) = propose(proposer, batch, [[5]])
    assert draft == [6, 9, 9, 5]


def test_a_request_keeps_its_drafter_when_rows_move_pause_and_finish():
    proposer = SpecfreeProposer(vllm_config(["strategy=trie"], max_num_seqs=2))
    batch = Batch()
    prompts = {name: [20 + i, 3, 4, 5, 6, 20 + i] for i, name in enumerate("abc")}
    for row, name in enumerate("abc"):
        batch.put(row, prompts[name] + [1])
    propose(proposer, batch, [[1], [1], [1]])
    a, b, c = (proposer.drafters.rows[row] for row in range(3))
    assert len({id(a), id(b), id(c)}) == 3
    # "a" finishes; vLLM moves "c" (last row) into row 0.
    batch.put(0, batch.context(2).tolist() + [2])
    batch.grow(1, [2])
    propose(proposer, batch, [[2], [2]])
    assert proposer.drafters.rows[0] is c and proposer.drafters.rows[1] is b
    assert list(proposer.drafters.parked.values()) == [a]
    # "b" is paused by the scheduler for a step, then comes back on row 1.
    batch.grow(0, [3])
    propose(proposer, batch, [[3]])
    batch.grow(1, [3])
    propose(proposer, batch, [[3], [3]])
    assert proposer.drafters.rows[1] is b
    # A new request with the same prompt as "c" gets a drafter of its own.
    batch.grow(0, [4])
    batch.grow(1, [4])
    batch.put(2, prompts["c"] + [1])
    propose(proposer, batch, [[4], [4], [1]])
    assert proposer.drafters.rows[2] not in (a, b, c)


def test_parked_drafters_are_bounded_and_their_strategies_reused():
    proposer = SpecfreeProposer(vllm_config(["strategy=prompt_lookup"], max_num_seqs=2))
    batch = Batch(rows=1)
    built = set()
    for request in range(6):
        batch.put(0, [40 + request, 3, 4, 3])
        propose(proposer, batch, [[3]])
        built.add(id(proposer.drafters.rows[0].strategy))
    drafters = proposer.drafters
    assert len(drafters.parked) <= 2 and len(drafters) <= 3
    assert len(built) < 6  # ended requests' strategies were handed to new ones


def test_rows_without_sampled_tokens_draft_nothing_and_keep_their_drafter():
    proposer = SpecfreeProposer(vllm_config(["strategy=prompt_lookup"]))
    batch = Batch()
    batch.put(0, REPEAT + [5])
    propose(proposer, batch, [[5]])
    drafter = proposer.drafters.rows[0]
    assert propose(proposer, batch, [[]]) == [[]]
    batch.grow(0, [6])
    propose(proposer, batch, [[6]])
    assert proposer.drafters.rows[0] is drafter


def test_drafts_stop_at_the_model_length():
    proposer = SpecfreeProposer(vllm_config(["strategy=prompt_lookup"]))
    batch = Batch()
    batch.put(0, (REPEAT * 11)[:254])
    (draft,) = propose(proposer, batch, [[REPEAT[253 % len(REPEAT)]]])
    assert len(draft) == 1


@pytest.mark.parametrize("spec, words", [
    (["strategy=nope"], "unknown strategy 'nope'"),
    (["strategy=trie", "strategy.decoding_length=0"], "decoding_length"),
    (42, "must be a specfree config"),
])
def test_bad_specfree_config_is_one_line(spec, words):
    with pytest.raises(ConfigError, match=words) as info:
        SpecfreeProposer(vllm_config(spec))
    assert "\n" not in str(info.value)


def test_missing_vllm_is_one_line():
    from specfree.integrations.vllm import check_environment

    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="vLLM is not installed") as info:
            check_environment()
        assert "\n" not in str(info.value)
    else:
        pytest.skip("vLLM is installed here")


def test_vllm_args_name_the_proposer_and_refuse_a_bad_config_before_vllm_starts():
    from specfree.integrations.vllm import PROPOSER, vllm_args

    args = vllm_args(3, ["strategy=trie"])
    assert args == {"speculative_config": {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 3},
                    "additional_config": {"specfree": ["strategy=trie"]}}
    with pytest.raises(ConfigError, match="has no knob 'nope'"):
        vllm_args(3, {"strategy": {"name": "trie", "nope": 1}})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        vllm_args(0)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_step_time_is_learned_from_clean_decode_steps_only():
    clock = FakeClock()
    proposer = SpecfreeProposer(vllm_config(["strategy=prompt_lookup"]), clock=clock)
    batch = Batch()
    batch.put(0, REPEAT + [5])
    (draft,) = propose(proposer, batch, [[5]])  # after the request's prefill
    for _ in range(4):
        clock.now += 0.010 + 0.001 * (1 + len(draft))  # vLLM's step: 10 ms and 1 ms a token
        emitted = draft + [5 + (draft[-1] - 4) % 8]  # every draft accepted, then vLLM's own token
        batch.grow(0, emitted)
        (draft,) = propose(proposer, batch, [emitted])
    samples = {n: list(times) for n, times in proposer.steps.samples.items()}
    assert sorted(samples) == [5] and samples[5] == pytest.approx([0.015] * 4)
    batch.put(1, [70, 71, 72, 70])  # a new request joins: its step held a prefill, so it is not timed
    clock.now += 0.2
    propose(proposer, batch, [[draft[0]], [70]])
    assert sum(map(len, proposer.steps.samples.values())) == 4


@pytest.mark.parametrize("per_token, longest", [(0.0005, K), (1.0, 0)])
def test_chains_are_priced_on_the_measured_step_time(per_token, longest):
    proposer = SpecfreeProposer(vllm_config(["strategy=prompt_lookup"]))
    for tokens in (1, 5):  # vLLM's step: 20 ms, then per_token for each token it verifies
        for _ in range(3):
            proposer.steps.started(tokens, 0.0)
            proposer.steps.finished(0.020 + per_token * (tokens - 1), timed=True)
    batch = Batch()
    batch.put(0, REPEAT + [5])
    (draft,) = propose(proposer, batch, [[5]])
    assert len(draft) == longest  # cheap rows: the whole chain; dear ones: nothing is worth a row


def test_the_global_suffix_tree_is_shared_by_every_request():
    proposer = SpecfreeProposer(vllm_config(["strategy=suffix", "strategy.priced=false"]))
    batch = Batch()
    batch.put(0, [20, 3, 4])
    propose(proposer, batch, [[4]])
    for token in (7, 8, 9, 10, 11, 12):  # request A's output, a token a step
        batch.grow(0, [token])
        propose(proposer, batch, [[token]])
    first = proposer.drafters.rows[0].strategy
    batch.put(0, [30, 31, 7, 8])  # A finished; B, on its row, has just emitted what A did after 7
    batch.put(1, [40, 41, 7, 8])  # and C, a second row at the same time
    drafts = propose(proposer, batch, [[8], [8]])
    # From A's output (their own text has no "8 ..."), as long as the match: max_spec_factor 1 x "7 8".
    assert drafts == [[9, 10], [9, 10]]
    b, c = (proposer.drafters.rows[row].strategy for row in (0, 1))
    assert len({id(first), id(b), id(c)}) == 3 and b.pool is c.pool is first.pool
    assert b.local is not c.local


@pytest.mark.parametrize("live", [True, False])
def test_running_requests_draft_from_each_others_output_as_it_is_written(live):
    """vLLM's batch rows run side by side: with live_outputs (the default, as vLLM's suffix does) a
    request's output reaches the shared tree while it runs, so another row drafts from it; without,
    only once it ends."""
    knobs = ["strategy=suffix", "strategy.priced=false"] + ([] if live else ["strategy.live_outputs=false"])
    proposer = SpecfreeProposer(vllm_config(knobs))
    batch = Batch()
    batch.put(0, [20, 3, 4])
    batch.put(1, [30, 31, 32])
    propose(proposer, batch, [[4], [32]])
    for token in (7, 8, 9, 10, 11, 12):  # row 0 writes its output; row 1 waits on an unrelated token
        batch.grow(0, [token])
        batch.grow(1, [33])
        propose(proposer, batch, [[token], [33]])
    batch.grow(0, [13])
    batch.grow(1, [7, 8])  # row 1 has just emitted what row 0 wrote after 7, while row 0 still runs
    drafts = propose(proposer, batch, [[13], [7, 8]])
    assert drafts[1] == ([9, 10] if live else [])


def test_before_two_token_counts_are_timed_each_token_costs_the_prior_slope():
    from specfree.cost import StepTimes

    clock = StepTimes(min_samples=1, prior_slope=0.05)
    assert clock.curve()(11) / clock.curve()(1) == pytest.approx(1.5)  # nothing timed: the prior alone
    clock.started(52, 0.0)
    clock.finished(0.153, timed=True)  # one count timed: the prior, anchored on it
    assert clock.curve()(52) == pytest.approx(0.153)
    assert clock.curve()(1) == pytest.approx(0.153 / (1 + 0.05 * 51))


def test_the_learned_step_curve_keeps_its_slope_below_the_fewest_tokens_timed():
    from specfree.cost import StepTimes

    clock = StepTimes(min_samples=1)
    for tokens, seconds in ((13, 0.080), (52, 0.158)):  # 2 ms a token
        clock.started(tokens, 0.0)
        clock.finished(seconds, timed=True)
    curve = clock.curve()
    assert curve(52) == pytest.approx(0.158) and curve(13) == pytest.approx(0.080)
    assert curve(5) == pytest.approx(0.064)  # not held at 13 tokens' time, which made them free

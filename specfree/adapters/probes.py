"""Probe forwards run once when a model is wrapped, and the choice they make: how its drafts are verified.

- ``tree``: draft trees under specfree's 4D mask (siblings hidden from each other).
- ``chain, custom mask``: one chain a step, under specfree's causal 4D mask; for a model that takes a
  4D mask but fails the tree probe, so specfree still masks its sliding windows.
- ``chain, own mask``: one chain a step with no mask passed; the model's own causal mask over the
  new rows is exactly right for a chain. Recurrent and chunked-attention models, models without a
  KV cache, and models that reject or ignore a custom 4D mask (ALiBi families, some decoders of
  encoder-decoder models) run so.

Each probe compares logits against plain causal forwards; a model that fails every mode is refused
with an ``UnsupportedModelError`` naming its family and the reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace

import torch

from specfree.adapters import recurrent
from specfree.adapters.capabilities import CHAIN_CUSTOM_MASK, CHAIN_OWN_MASK, MODES, TREE, Capabilities, Windows
from specfree.adapters.runners import EagerRunner
from specfree.errors import UnsupportedModelError, one_line

__all__ = ["CHAIN_CUSTOM_MASK", "CHAIN_OWN_MASK", "MODES", "TREE", "inspect_model"]


def inspect_model(caps: Capabilities, adapter_for: Callable, *, compiled: bool = False,
                  probe: bool = True) -> Capabilities:
    """The record for a model whose structure gave ``caps`` (``capabilities.model_structure``), with
    the verification mode the probes choose, or a refusal. ``adapter_for(caps)`` wraps the (prepared)
    model with a record, for the probes to run on. ``compiled``: for static slots, which take trees
    only (probed on the runner's eager steps); ``probe=False``: the structure's record as it is."""
    if compiled and caps.chain_only:
        raise UnsupportedModelError(f"model family '{caps.family}' verifies chains, which run on the eager "
                                    "path only")
    if not probe:
        return caps
    adapter = adapter_for(caps)
    if compiled:
        with adapter.store.eager_steps():  # no graphs for the probes' shapes
            check_causal(adapter)
            check_tree_mask(adapter)
        return caps
    check_causal(adapter)
    if caps.chain_only:  # its layers cannot branch (recurrent state, chunked attention, no KV cache)
        try:
            return check_chain(adapter)
        except UnsupportedModelError as refusal:
            check_split_invariant(adapter, refusal)  # the cause, where it lies in transformers itself
            raise
    tree_failure = tree_mask_failure(adapter)
    if tree_failure is None:
        return caps
    # specfree's own mask where the model honours one (it keeps masking sliding windows), else none,
    # under which the model masks its own windows too
    modes = [CHAIN_CUSTOM_MASK, CHAIN_OWN_MASK] if honours_custom_masks(adapter) else [CHAIN_OWN_MASK]
    for mode in modes:
        windows = caps.windows if mode == CHAIN_CUSTOM_MASK else Windows()
        try:
            return check_chain(adapter_for(replace(caps, verification=mode, why_chains=tree_failure, windows=windows)))
        except UnsupportedModelError as refusal:
            chain_refusal = refusal
    check_split_invariant(adapter, chain_refusal)  # the cause of both failures, where it lies in transformers
    raise UnsupportedModelError(f"model family '{caps.family}' {tree_failure}, and its chains fail too: "
                                f"{chain_refusal}") from chain_refusal


def check_tree_mask(adapter) -> None:
    """Refuse, by name, a model that silently ignores a custom 4D mask or position ids."""
    failure = tree_mask_failure(adapter)
    if failure is not None:
        raise UnsupportedModelError(f"model family '{adapter.family}' {failure}. Load it with "
                                    "attn_implementation='sdpa' or 'eager', or use another model family.")


@contextmanager
def probing(adapter, what: str, fix: str):
    """Run a probe on an empty cache and leave it empty; a forward the family's code rejects
    refuses the model by name."""
    adapter.reset()
    try:
        yield
    except UnsupportedModelError:
        raise
    except Exception as exc:
        cause = f"{type(exc).__name__}: {one_line(exc)}"
        raise UnsupportedModelError(f"model family '{adapter.family}' cannot run {what} ({cause}). {fix}") from exc
    finally:
        adapter.reset()


def close(adapter, ours: torch.Tensor, reference: torch.Tensor) -> bool:
    scale = reference.float().abs().max().clamp(min=1.0)
    tol = 1e-3 if adapter.dtype == torch.float32 else 5e-2
    return bool(((ours.float() - reference.float()).abs().max() / scale) <= tol)


def _ids(adapter, n: int) -> torch.Tensor:
    return torch.arange(3, 3 + n) % min(adapter.vocab_size, 1000)


def check_causal(adapter) -> None:
    """Refuse, by name, a model whose rows see the rows after them (an encoder loaded as a causal
    LM): a row's logits must not change when later tokens are appended."""
    ids = _ids(adapter, 5)
    with probing(adapter, "specfree's forward", "Use another model family."):
        whole = adapter.run_plain(ids, torch.arange(5))[:3]
        adapter.reset()
        first = adapter.run_plain(ids[:3], torch.arange(3))
    if not close(adapter, whole, first):
        raise UnsupportedModelError(
            f"model family '{adapter.family}' is not causal: a row's logits change when later tokens are "
            "appended (bidirectional attention, e.g. an encoder loaded with is_decoder=False), so "
            "speculative rows would see the future and give wrong output. Load it as a decoder "
            "(is_decoder=True) or use a causal model family.")


def tree_mask_failure(adapter) -> str | None:
    """Why the model cannot verify trees (a phrase following its family's name), or None.

    Two sibling rows must not see each other: the second sibling's logits must equal a plain
    forward over its own prefix.
    """
    ids = _ids(adapter, 5)  # prefix a b c, root d, siblings e f
    prefix, root, e, f = ids[:3], ids[3:4], ids[4:5], ids[4:5] + 1
    try:
        with probing(adapter, "specfree's tree attention", ""):
            reference = adapter.run_plain(torch.cat([prefix, root, f]), torch.arange(5))[-1]
            adapter.reset()
            adapter.prefill(prefix)
            allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
            tree = adapter.forward(torch.cat([root, e, f]), allowed, torch.tensor([3, 4, 4]))[-1]
    except UnsupportedModelError as refusal:
        return str(refusal).removeprefix(f"model family '{adapter.family}' ").rstrip(". ")
    if not close(adapter, tree, reference):
        return (f"ignores custom 4D attention masks or position ids (attn_implementation="
                f"{adapter.model.config._attn_implementation!r}): a draft row's logits differ from a plain "
                "forward over its own prefix")
    return None


def honours_custom_masks(adapter) -> bool:
    """Whether a custom 4D mask changes what a row sees: hiding the row before the last one from it
    must change its logits (a model that ignores or rejects masks gives the plain causal logits)."""
    ids = _ids(adapter, 3)
    positions = torch.arange(3)
    hidden = torch.ones(3, 3, dtype=torch.bool).tril()
    hidden[2, 1] = False
    try:
        with probing(adapter, "a custom mask", ""):
            causal = adapter.run_plain(ids, positions)[-1]
            adapter.reset()
            masked = adapter.forward(ids, hidden, positions)[-1]
    except UnsupportedModelError:
        return False
    return not close(adapter, masked, causal)


def check_split_invariant(adapter, refusal: UnsupportedModelError) -> None:
    """Refuse, naming the cause, a model whose own forward gives logits that depend on how the tokens
    are split between forwards: over the cache ``generate`` builds, a cached prefix then one token at a
    time must give the logits of one forward over the whole sequence. Where it does not (Dory's
    ``recurrent_kv_cache_mode="last_loop"``: earlier loops read the last loop's keys for cached tokens but
    their own for new ones), rows verified together in one forward cannot reproduce ``generate``'s
    one-token steps, whatever the mask, and the tree and chain probes fail for that reason. Run only on a
    refusal (``refusal``, which it chains), so models that pass pay nothing."""
    caps = adapter.capabilities
    if not caps.keeps_cache:
        return  # a model without a KV cache runs the whole sequence every time
    runner, device = EagerRunner(adapter.model, caps.cache_argument, caps.takes_positions), adapter.device

    def run(ids: torch.Tensor, positions: torch.Tensor, cache):
        logits, cache = runner(ids.to(device)[None], positions.to(device)[None], None, cache)
        return logits[0], cache

    ids = _ids(adapter, 7)
    try:
        with probing(adapter, "its own cache", ""):
            whole = run(ids, torch.arange(7), recurrent.generate_cache(adapter.model))[0][3:]
            _, cache = run(ids[:3], torch.arange(3), recurrent.generate_cache(adapter.model))
            singles = []
            for i in range(3, 7):
                logits, cache = run(ids[i : i + 1], torch.tensor([i]), cache)
                singles.append(logits[-1])
            singles, held = torch.stack(singles), _cached_tokens(cache)
    except UnsupportedModelError:
        return  # its own cache does not run here either: the refusal stands as it is
    if held is not None and held != 7:
        return  # the forward does not keep the tokens in the cache it is given: the refusal says so
    if not close(adapter, singles, whole):
        raise UnsupportedModelError(
            f"model family '{adapter.family}' gives logits that depend on how the tokens are split between "
            "forwards, in transformers itself: over the cache generate builds, a cached prefix then one token "
            "at a time differs from one forward over the whole sequence, so draft rows verified together in one "
            "forward (a tree or a chain alike) cannot reproduce generate's one-token steps. Use another model "
            "family or configuration.") from refusal


def _cached_tokens(cache) -> int | None:
    """How many tokens ``cache`` holds, None where it cannot say (recurrent layers only)."""
    try:
        return int(cache.get_seq_length())
    except Exception:
        return None


def check_chain(adapter) -> Capabilities:
    """A chain of rows after a cached prefix, and the cache cut (or the state rolled back) to part
    of it, must give the logits of one row at a time (what ``generate`` runs). If the model's
    multi-row forward does not continue its state, drafts cannot be verified at all: every step is
    then one row (plain decoding), with a warning."""
    ids = _ids(adapter, 7)  # prefix a b c, chain d e f, then g
    with probing(adapter, "specfree's forward", "Use another model family."):
        whole = adapter.run_plain(ids[:7], torch.arange(7))[3:]
        adapter.reset()
        adapter.prefill(ids[:3])
        singles = []
        for i in range(3, 7):
            singles.append(adapter.forward(ids[i : i + 1])[-1])
            adapter.commit([0], rows=1)
        adapter.reset()
        adapter.prefill(ids[:3])
        chain = adapter.forward(ids[3:6])
        adapter.commit([0, 1], rows=3)  # reject f: the cache goes back to after e
        after_rollback = adapter.forward(ids[5:7])  # f again, then g
    family = adapter.family
    if not close(adapter, torch.stack(singles), whole):
        raise UnsupportedModelError(
            f"model family '{family}' does not keep its state in the cache specfree passes it "
            f"({adapter.capabilities.cache_argument}): one token at a time after a cached prefix differs from a "
            "forward over the whole sequence. Use another model family.")
    if not close(adapter, chain, torch.stack(singles[:3])):
        warnings.warn(f"model family '{family}': this transformers version's forward does not carry "
                      "the recurrent state through several new tokens at once, so drafts cannot be checked; "
                      "decoding one token per step (plain speed, same output)", stacklevel=4)
        return replace(adapter.capabilities, max_chain=0)
    if not close(adapter, after_rollback, torch.stack(singles[2:4])):
        raise UnsupportedModelError(
            f"model family '{family}' keeps state that specfree cannot roll back (a rejected draft "
            "would change later output). Use another model family.")
    return adapter.capabilities

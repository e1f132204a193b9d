"""What a model can do under specfree, decided once when it is wrapped: one frozen record.

``model_structure`` reads what the model's structure alone decides (refusals, context and row
limits, cache kind, attention windows, whether layers can branch a tree, whether the compiled path
can run it); ``probes.inspect_model`` then runs a few probe forwards and returns the record with
the verification mode they chose. Adapters pick their KV store and runner from it, the engine
plans its steps from it (tree or chain, chain limit, rollback) and ``describe()`` prints it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from specfree.adapters import recurrent
from specfree.adapters.kv_buffers import cache_argument
from specfree.adapters.refusals import layer_kinds, refuse_unverifiable
from specfree.masks.bucketed import static_mask
from specfree.masks.tree import additive_mask

# How drafts are verified (``probes`` chooses).
TREE = "tree"
CHAIN_CUSTOM_MASK = "chain, custom mask"
CHAIN_OWN_MASK = "chain, own mask"
MODES = {
    TREE: "draft trees under specfree's 4D attention mask",
    CHAIN_CUSTOM_MASK: "one chain a step under specfree's causal 4D mask",
    CHAIN_OWN_MASK: "one chain a step under the model's own causal mask",
}
# Layer kinds one additive mask per kind can express (the names models use in ``layer_types``).
MASKABLE_LAYERS = {"full_attention", "sliding_attention"}


def causal(rows: int) -> torch.Tensor:
    """[rows, rows] bool: each row sees itself and the rows before it."""
    return torch.ones(rows, rows, dtype=torch.bool).tril()


@dataclass(frozen=True)
class Windows:
    """Attention windows specfree's masks apply: one for every layer (``sliding``), or one per
    layer kind (``per_kind``: Gemma2/3, Cohere2... take the dict ``{layer kind: mask}``)."""

    sliding: int | None = None
    per_kind: Mapping[str, int | None] | None = None

    @property
    def narrowest(self) -> int | None:
        """The narrowest window of any layer (masks are needed once it is exceeded)."""
        return self.sliding or (self.per_kind or {}).get("sliding_attention")

    def mask(self, allowed: torch.Tensor, past: int, positions: torch.Tensor, dtype: torch.dtype,
             device: torch.device, slots: int | None = None):
        """The additive mask [1, 1, Q, past+Q] (or over all ``slots`` static slots), or one per layer kind."""
        positions = positions.cpu()

        def one(window: int | None) -> torch.Tensor:
            if slots is None:
                return additive_mask(allowed, past, positions, dtype, window).to(device)
            return static_mask(allowed, past, positions, slots, dtype, window).to(device)

        return one(self.sliding) if self.per_kind is None else {k: one(w) for k, w in self.per_kind.items()}


@dataclass(frozen=True)
class Capabilities:
    """What specfree does with one model; frozen once the model is wrapped."""

    family: str
    vocab_size: int
    max_length: int  # tokens of context decoded up to
    cache_kind: str  # "growing", "states" or "own" (``recurrent.cache_kind``)
    keeps_cache: bool  # False: the forward takes no cache, each step reruns the whole sequence
    cache_argument: str | None  # what the forward calls its cache
    takes_positions: bool  # Mamba-style forwards take no position ids
    verification: str = TREE  # a key of ``MODES``
    why_chains: str | None = None  # why not trees (a phrase following the family's name)
    max_chain: int | None = None  # drafts a chain may hold (0: one row a step), None: any
    windows: Windows = field(default_factory=Windows)
    compile_blocker: str | None = None  # why the compiled path cannot run this model here, or None
    # Which attention the prepared model runs (``attention.attention_path``: "tree_attention",
    # "grouped_sdpa", or transformers' own name), decided once when the adapter swaps its kernels in.
    attention: str | None = None

    @property
    def chain_only(self) -> bool:
        return self.verification != TREE

    @property
    def chain_mask(self) -> bool:
        """Whether chain rows get specfree's causal 4D mask (else none: the model's own)."""
        return self.verification == CHAIN_CUSTOM_MASK

    @property
    def rollback(self) -> bool:
        """Whether a cut chain puts states back and replays the kept rows (pricing counts that)."""
        return self.chain_only and self.cache_kind != "growing"

    @property
    def store(self) -> str:
        """The eager KV store this model needs (a name in ``stores.STORES``)."""
        if not self.keeps_cache:
            return "rerun"
        return "growing" if self.cache_kind == "growing" else "recurrent"

    def describe(self) -> str:
        """How drafts are verified on this model (the probes' choice, and why not trees)."""
        text = f"{self.family}: verifies {MODES[self.verification]}"
        if self.max_chain == 0:
            text += " (one row a step: the forward cannot continue its state over several tokens)"
        elif not self.keeps_cache:
            text += ", the whole sequence run again each step (the model keeps no KV cache)"
        elif self.why_chains:
            text += f" (no draft trees: it {self.why_chains})"
        return text


def context_limit(config) -> int:
    # MPT names it max_seq_len (its ALiBi bias is built that long: a longer context fails inside it).
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def why_no_trees(model) -> str | None:
    """Why ``model``'s structure rules out draft trees (a phrase following its family's name), or None."""
    kind = recurrent.cache_kind(model)
    if kind == "states":
        return "has recurrent layers, whose states a tree cannot branch"
    if kind == "own":
        return "keeps a cache of its own kind, which specfree copies whole to roll back and a tree cannot branch"
    unmaskable = layer_kinds(model) - MASKABLE_LAYERS - {"dummy", "moe", "mlp"}
    if unmaskable:
        return f"has {', '.join(sorted(unmaskable))} layers, which one tree mask per layer kind cannot express"
    return None


def verifies_chains(model) -> bool:
    """Whether ``model`` verifies one chain per step instead of a tree, from its structure alone:
    recurrent layers cannot branch, layer kinds one mask per kind cannot express (chunked attention)
    take causal rows only, and a model without a KV cache reruns the whole sequence under its own
    causal mask. (Models that reject or ignore a custom mask are found by ``probes`` instead.)"""
    return cache_argument(model) is None or why_no_trees(model) is not None


def attention_windows(config, max_length: int) -> tuple[Windows, int]:
    """The windows specfree's masks apply, and the context limit: a model mixing window layers with
    kinds one mask per kind cannot express may only run within its window."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return Windows(), max_length
    kinds = set(getattr(config, "layer_types", None) or ["sliding_attention"])
    if kinds == {"sliding_attention"}:
        return Windows(sliding=window), max_length
    if kinds <= MASKABLE_LAYERS:
        return Windows(per_kind={"full_attention": None, "sliding_attention": window}), max_length
    return Windows(), min(max_length, window)


def compile_blocker(model) -> str | None:
    """Why the compiled path cannot run this model here, or None."""
    import shutil
    import sys

    device = model_device(model)
    if device.type not in ("cpu", "cuda"):
        return f"torch.compile is not used on {device.type} devices"
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        return "no C++ compiler was found (install g++ or clang++)"
    if sys.platform not in ("linux", "darwin"):
        return f"compiling the forward is supported on Linux and macOS, not {sys.platform}"
    if verifies_chains(model):
        return "models with recurrent or chunked-attention layers verify chains on the eager path only"
    return None


def model_device(model) -> torch.device:
    """Where the model's weights are: its first parameter's device (``model.device`` scans every
    parameter; an embedding tied to a packed head has no ``weight`` of its own to ask)."""
    return next(model.parameters()).device


def output_rows(model) -> int:
    """Rows of the LM head (its vocabulary), without materializing a packed head's weight."""
    head = model.get_output_embeddings()
    return head.out_features if hasattr(head, "out_features") else head.weight.shape[0]


def model_structure(model) -> Capabilities:
    """The record as the model's structure alone decides it (before any probe); refuses, by name,
    a model specfree cannot verify exactly (``refusals``)."""
    config = model.config
    max_length = context_limit(config)
    refuse_unverifiable(model, max_length)
    argument = cache_argument(model)
    chain_only = verifies_chains(model)
    # A chain's rows are causal: the model masks its own windows, over its own window layers.
    windows, max_length = (Windows(), max_length) if chain_only else attention_windows(config, max_length)
    return Capabilities(
        family=config.model_type, vocab_size=output_rows(model), max_length=max_length,
        cache_kind=recurrent.cache_kind(model), keeps_cache=argument is not None, cache_argument=argument,
        takes_positions="position_ids" in inspect.signature(model.forward).parameters or not chain_only,
        verification=CHAIN_OWN_MASK if chain_only else TREE,
        why_chains=why_no_trees(model) if chain_only and argument is not None else None,
        windows=windows, compile_blocker=compile_blocker(model))

"""Adapter over any transformers causal LM that takes a 4D additive mask and position ids.

The committed KV lives in a cache of ``kv.GrowingLayer``s (transformers' ``DynamicLayer``,
appending in place; no sliding-window layers, so cache index == position). After each step only
the accepted rows' KV is kept, by moving them down in place and cutting the tail: no second
forward. Sliding-window layers keep their whole KV too; the mask hides what falls outside their
window. Grouped-query models on the CPU run ``attention.grouped_sdpa_attention``, which spares
masked steps a copy of the cache, linear layers on the CPU run specfree's few-row kernel
(``specfree.kernels``: a step's rows cost about what one row costs), and Llama-style RMSNorm
layers run as one ``torch.rms_norm`` call (``norms``).

Models whose layers keep a recurrent state (Mamba/SSM, linear attention) verify one chain per step
and roll their state back after the verdict (``recurrent``); ``chain_only`` tells the engine. So do
models whose forward cannot verify a tree (it rejects or ignores a custom 4D mask or the position
ids: ALiBi families, some encoder-decoder decoders), under specfree's causal mask or their own, and
models without a KV cache (GPT-1, RWKV), which run the whole sequence each step. Probe forwards
choose the mode when a model is wrapped (``probes``); ``verification`` and ``describe()`` say which.

The adapter is composed of parts: the model's kernels (``prepare_model``: few-row linears, fused
norms, grouped attention), a KV store (a growing cache, recurrent state snapshots, or
``kv.StaticSlots``) and, with static slots, a runner that executes the steps (``runners``: an
AOTInductor package or torch.compile graphs; ``compiled.compiled_adapter`` puts those together).
"""

from __future__ import annotations

import inspect
import time
import warnings
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from specfree.adapters import probes, recurrent
from specfree.adapters.attention import use_grouped_sdpa, use_tree_attention
from specfree.adapters.kv import StaticSlots, cache_argument, cache_in
from specfree.adapters.norms import fuse_norms
from specfree.adapters.refusals import layer_kinds, refuse_unverifiable
from specfree.adapters.runners import StepRunner
from specfree.errors import UnsupportedModelError
from specfree.kernels import linear_path, use_few_row_linears
from specfree.masks.bucketed import pad_rows, static_mask
from specfree.masks.tree import additive_mask


def context_limit(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


# Layer kinds one additive mask per kind can express (the names models use in ``layer_types``).
MASKABLE_LAYERS = {"full_attention", "sliding_attention"}


def keeps_kv_cache(model) -> bool:
    """Whether the model's forward takes a cache at all (GPT-1's does not: it reruns the whole sequence)."""
    return cache_argument(model) is not None


def verifies_chains(model) -> bool:
    """Whether ``model`` verifies one chain per step instead of a tree, from its structure alone:
    recurrent layers cannot branch, layer kinds one mask per kind cannot express (chunked attention)
    take causal rows only, and a model without a KV cache reruns the whole sequence under its own
    causal mask. (Models that reject or ignore a custom mask are found by ``probes`` instead.)"""
    return not keeps_kv_cache(model) or why_no_trees(model) is not None


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


def ignores_custom_masks(attn_implementation: str | None) -> bool:
    """Flash-attention kernels take no arbitrary mask: tree rows would see their siblings."""
    return "flash" in str(attn_implementation or "")


def use_maskable_attention(model) -> None:
    """Switch a flash-attention model to SDPA (or eager, for families without SDPA), which take
    the tree mask: same weights, same math."""
    current = model.config._attn_implementation
    if not ignores_custom_masks(current):
        return
    reasons = []
    for fallback in ("sdpa", "eager"):
        try:
            model.set_attn_implementation(fallback)
        except (ValueError, ImportError) as exc:  # the family lacks this implementation
            reasons.append(f"{fallback}: {exc}")
            continue
        if model.config._attn_implementation == fallback:
            warnings.warn(f"attn_implementation={current!r} cannot take specfree's tree attention mask; "
                          f"switched this model to {fallback!r}", stacklevel=4)
            return
        reasons.append(f"{fallback}: the model does not switch attention after loading")
    raise UnsupportedModelError(
        f"model family '{model.config.model_type}' runs {current!r}, which cannot take specfree's tree "
        f"attention mask, and could not be switched ({'; '.join(reasons)}). Load it with "
        "attn_implementation='sdpa' or 'eager'.")


def prepare_model(model, grouped_attention: bool = True, linear_kernel: str = "few_row",
                  cache_dir: str | None = None) -> int:
    """Swap in the kernels every adapter runs (each swap computes the same function; doing it twice
    changes nothing): attention that takes a tree mask, grouped-query SDPA without a per-step copy
    of the cache, specfree's few-row linear kernel, fused RMSNorms. Returns how many linear layers
    run the kernel."""
    use_maskable_attention(model)
    if grouped_attention:
        # each row's bits independent of the step's other rows; else the same math as SDPA without a
        # per-step copy of the cache for masked rows
        use_tree_attention(model, cache_dir) or use_grouped_sdpa(model)
    kernel_linears = use_few_row_linears(model, linear_kernel, cache_dir)  # rows at one row's price
    fuse_norms(model)  # bit-identical, fewer dispatches per forward
    return kernel_linears


class HFAdapter:
    name = "hf"

    def __init__(self, model: PreTrainedModel, check_tree_mask: bool = True, grouped_attention: bool = True,
                 linear_kernel: str = "few_row", cache_dir: str | None = None, *,
                 runner: StepRunner | None = None):
        """``linear_kernel``: ``"few_row"`` runs CPU linear layers through specfree's kernel
        (``specfree.kernels``; built once under ``cache_dir``, the library's where it cannot be),
        ``"library"`` keeps torch's ``F.linear``. ``runner``: run the steps over its static KV
        slots (``runner.slots``) instead of eager forwards over a growing cache; tree-verified
        models only."""
        self.model = model.eval()
        self._embeddings = model.get_input_embeddings()
        config = model.config
        self.family = config.model_type
        self.max_length = context_limit(config)
        refuse_unverifiable(model, self.max_length)
        self.kernel_linears = prepare_model(model, grouped_attention, linear_kernel, cache_dir)
        self.runner = runner
        self.slots: StaticSlots | None = runner.slots if runner is not None else None
        self._step_start = 0  # the slot where the last step began (static slots)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        # Recurrent layers cannot branch, and layer kinds one mask per kind cannot express (chunked
        # attention) can still take causal rows: one chain per step (max_chain drafts, None: any).
        self.cache_kind = recurrent.cache_kind(model)
        self.keeps_cache = keeps_kv_cache(model)
        self.chain_only = verifies_chains(model)
        if self.chain_only and self.slots is not None:
            raise UnsupportedModelError(f"model family '{self.family}' verifies chains, which run on the eager "
                                        "path only")
        self.verification = probes.CHAIN_OWN_MASK if self.chain_only else probes.TREE
        self.chain_mask = False  # whether chain rows get specfree's causal 4D mask (else none)
        # why not trees: the structure's reason, or the tree probe's finding (``use_chains``)
        self.why_chains: str | None = why_no_trees(model) if self.chain_only and self.keeps_cache else None
        # A chain's rows are causal: the model masks its own windows, over its own window layers.
        self.sliding_window, self.layer_windows = (None, None) if self.chain_only else self._attention_windows(config)
        self.max_chain: int | None = None
        self.rollback_s = 0.0  # the last commit's rollback time (chain-only models)
        self._step: tuple | None = None
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = cache_argument(model)
        # Mamba-style models take no positions, and pass unknown arguments on to their kernels.
        self._takes_positions = "position_ids" in parameters or not self.chain_only
        self.reset()
        # Rollbacks re-run only the state-writing mixers where they can be found, else the whole model.
        self.replay = recurrent.MixerReplay.find(model, self.cache, lambda: self.prefill(torch.arange(3, 6))) \
            if self.cache_kind == "states" else None
        self.reset()
        if self.slots is not None:
            if check_tree_mask:  # a model that fails it verifies chains: on the eager path
                with self._eager_steps():  # no graphs for the probes' shapes
                    self.check_causal()
                    self.check_tree_mask()
        elif check_tree_mask:
            probes.choose_verification(self)  # tree, or chains where the probes say so, or refused

    @property
    def device(self) -> torch.device:
        return self._embeddings.weight.device  # model.device scans the parameters: slow, several calls a step

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def past_len(self) -> int:
        if self.slots is not None:
            return self.slots.past
        if not self.keeps_cache:
            return self._ids.numel()
        return self.cache.get_seq_length() if self.cache_kind == "growing" else self._length

    def _attention_windows(self, config) -> tuple[int | None, dict[str, int | None] | None]:
        """(the window every layer uses, or None; per layer kind windows when kinds are mixed, or None).

        Mixed sliding/full layers (Gemma2/3, Cohere2...) get one mask per kind, passed as the
        dict ``{layer kind: mask}`` the model's forward accepts from ``generate``. Other layer
        kinds (chunked, linear attention...) cannot be expressed so: such a model may then only
        run within its window.
        """
        window = getattr(config, "sliding_window", None)
        if not window or getattr(config, "use_sliding_window", True) is False:
            return None, None
        kinds = set(getattr(config, "layer_types", None) or ["sliding_attention"])
        if kinds == {"sliding_attention"}:
            return window, None
        if kinds <= MASKABLE_LAYERS:
            return None, {"full_attention": None, "sliding_attention": window}
        self.max_length = min(self.max_length, window)
        return None, None

    @property
    def window(self) -> int | None:
        """The narrowest attention window of any layer (masks are needed once it is exceeded)."""
        return self.sliding_window or (self.layer_windows or {}).get("sliding_attention")

    def _mask(self, allowed: torch.Tensor, past: int, positions: torch.Tensor):
        """The additive mask [1,1,Q,past+Q], or one per layer kind for mixed-window models."""
        if self.layer_windows is None:
            return additive_mask(allowed, past, positions.cpu(), self.dtype, self.sliding_window).to(self.device)
        return {kind: additive_mask(allowed, past, positions.cpu(), self.dtype, window).to(self.device)
                for kind, window in self.layer_windows.items()}

    def reset(self) -> None:
        if self.slots is not None:
            self.cache = None  # the KV lives in the static slots
            self.slots.reset()
            return
        self.cache = recurrent.new_cache(self.model, self.cache_kind)
        self._length = 0  # tokens in the cache (recurrent layers have no sequence axis to read it from)
        self._ids = torch.zeros(0, dtype=torch.long)  # the tokens so far, for a model without a KV cache
        self._step = None

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> None:
        """Cache the KV of ``ids`` [L] (a plain causal forward; its logits are not needed)."""
        if ids.numel() == 0:
            return
        if self.slots is not None:
            self._prefill_slots(ids)
            return
        if not self.keeps_cache:  # nothing to cache: the next forward runs these tokens with its own
            self._ids = torch.cat([self._ids, ids.cpu()])
            return
        past = self.past_len
        positions = torch.arange(past, past + ids.numel(), device=self.device)
        mask = None
        if self.window is not None and past + ids.numel() > self.window:
            mask = self._mask(torch.ones(ids.numel(), ids.numel(), dtype=torch.bool).tril(), past, positions)
        self._forward(ids, positions, mask, logits_to_keep=1)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, allowed: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [Q, V] for rows ``tokens`` [Q]; ``allowed`` [Q, Q] says which new rows each row sees.

        Without ``positions`` a row's position is the number of entries it sees minus one.
        ``allowed=None`` means plain causal rows.
        """
        past = self.past_len
        q = tokens.numel()
        if positions is None:
            seen = allowed.sum(-1) if allowed is not None else torch.arange(1, q + 1)
            positions = past + seen - 1
        if self.slots is not None:  # padded to the rows the runner takes; every slot masked
            if allowed is None:
                allowed = torch.ones(q, q, dtype=torch.bool).tril()
            padded = pad_rows(tokens.cpu(), allowed, positions.cpu(), self.runner.rows_for(q))
            return self._run_slots(*padded)[:q]
        causal = allowed is None or (q == 1 or bool(torch.equal(allowed, torch.ones(q, q, dtype=torch.bool).tril())))
        windowed = self.window is not None and past + q > self.window
        mask = None
        if not causal or windowed or (self.chain_mask and q > 1):
            if allowed is None:
                allowed = torch.ones(q, q, dtype=torch.bool).tril()
            mask = self._mask(allowed, past, positions)
        recurrent_chain = self.chain_only and self.cache_kind != "growing" and self.keeps_cache
        if recurrent_chain and q > 1:  # one row is always kept whole
            if not causal:
                raise ValueError("a model with recurrent layers verifies one chain per step, not a tree")
            self._step = (recurrent.snapshot(self.cache, self.cache_kind, past), tokens, positions)
            if self.replay is not None:
                hooks = self.replay.record()
                try:
                    return self._forward(tokens, positions, mask)
                finally:
                    for hook in hooks:
                        hook.remove()
        return self._forward(tokens, positions, mask)

    def _forward(self, tokens, positions, mask, logits_to_keep: int = 0) -> torch.Tensor:
        if self.slots is not None:  # plain causal rows (the probes' reference forward)
            q = tokens.numel()
            return self._run_slots(tokens.cpu(), torch.ones(q, q, dtype=torch.bool).tril(), positions.cpu())
        if not self.keeps_cache:  # no KV cache: the whole sequence again, its own causal mask, the new rows' logits
            q, self._ids = tokens.numel(), torch.cat([self._ids, tokens.cpu()])
            out = self.model(input_ids=self._ids.to(self.device)[None])
            return out.logits[0, -(logits_to_keep or q):]
        inputs = dict(input_ids=tokens.to(self.device)[None], attention_mask=mask, use_cache=True,
                      logits_to_keep=logits_to_keep)
        inputs[self._cache_argument] = self.cache
        if self._takes_positions:
            inputs["position_ids"] = positions.to(self.device)[None]
        out = self.model(**inputs)
        if self.cache is None:  # a family that builds its own cache class in its forward
            self.cache = cache_in(out)
        self._length += tokens.numel()
        return out.logits[0]

    @torch.inference_mode()
    def commit(self, keep: list[int], rows: int) -> None:
        """Keep the KV of this step's rows ``keep`` (ascending, keep[0] == 0), drop the rest.

        ``rows`` is how many rows the step's forward appended.
        """
        if self.slots is not None:  # padding rows included: the adapter knows where the step began
            self.slots.commit(keep, self._step_start)
            return
        past = self.past_len - rows
        n = len(keep)
        if not self.keeps_cache:  # a chain: its first n rows
            self._ids = self._ids[: past + n]
            return
        if self.chain_only and self.cache_kind != "growing":
            self._commit_chain(n, rows)
            return
        contiguous = keep[-1] == n - 1
        index = None if contiguous else torch.tensor(keep, device=self.device) + past
        for layer in self.cache.layers:
            if index is not None:
                # index_select copies first, so the in-place write cannot read moved rows.
                layer.keys[:, :, past : past + n] = layer.keys.index_select(2, index)
                layer.values[:, :, past : past + n] = layer.values.index_select(2, index)
            layer.keys = layer.keys[:, :, : past + n]
            layer.values = layer.values[:, :, : past + n]

    def _commit_chain(self, kept: int, rows: int) -> None:
        """Keep the first ``kept`` rows of a chain: when some were rejected, put the states back as
        they were before the step and run the kept rows again (their logits are not needed)."""
        self.rollback_s = 0.0
        if kept < rows:
            start = time.perf_counter()
            snapshot, tokens, positions = self._step
            if self.replay is not None and snapshot.keeps_rows(rows):
                self.cache = snapshot.restore(self.cache, kept, rows)
                if self.replay.replay(kept, rows):
                    self._length = snapshot.past + kept
                    self._step = None
                    self.rollback_s = time.perf_counter() - start
                    return
            self.cache = snapshot.restore(self.cache)
            self._length = snapshot.past
            self._forward(tokens[:kept], positions[:kept], None, logits_to_keep=1)  # chains need no mask
            self.rollback_s = time.perf_counter() - start
        self._step = None

    # ---- static slots, the steps run by ``self.runner`` -------------------------------------
    @property
    def compiled(self) -> bool:
        """Whether the steps run compiled code (False on the eager path, and once a compile failed)."""
        return self.runner is not None and self.runner.compiled

    @property
    def compile_s(self) -> float:
        return self.runner.compile_s if self.runner is not None else 0.0

    @property
    def failure(self) -> str | None:
        """Why the compiled steps were given up, if they were."""
        return self.runner.failure if self.runner is not None else None

    @property
    def linears(self) -> str:
        return linear_path(self.model)

    @contextmanager
    def _eager_steps(self):
        """The runner's steps run eagerly inside the block (no graphs or packages for its shapes)."""
        compiled, self.runner.compiled = self.runner.compiled, False
        try:
            yield
        finally:
            self.runner.compiled = compiled

    def _slots_mask(self, allowed: torch.Tensor, past: int, positions: torch.Tensor):
        """The additive mask over every slot [1, 1, Q, slots], or one per layer kind."""
        capacity, positions = self.slots.capacity, positions.cpu()
        if self.layer_windows is None:
            return static_mask(allowed, past, positions, capacity, self.dtype, self.sliding_window).to(self.device)
        return {kind: static_mask(allowed, past, positions, capacity, self.dtype, window).to(self.device)
                for kind, window in self.layer_windows.items()}

    def _run_slots(self, tokens: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of rows already padded for the runner; their KV goes into slots past..past+B."""
        past, rows = self.slots.past, tokens.numel()
        self._step_start = past
        self.slots.room(past + rows)
        mask = self._slots_mask(allowed, past, positions)
        # Fresh inference tensors: a graph's guards tell them from tensors made outside inference mode.
        logits = self.runner(tokens.to(self.device).clone()[None], positions.to(self.device).clone()[None], mask)
        self.slots.past = past + rows
        return logits[0]

    def _prefill_slots(self, ids: torch.Tensor) -> None:
        """Eager causal forwards into the slots (a graph per prompt length would never be reused)."""
        past, q = self.slots.past, ids.numel()
        self.slots.room(past + q)
        positions = torch.arange(past, past + q)
        mask = self._slots_mask(torch.ones(q, q, dtype=torch.bool).tril(), past, positions)
        self.model(input_ids=ids.to(self.device)[None], position_ids=positions.to(self.device)[None],
                   attention_mask=mask, use_cache=True, logits_to_keep=1, **{self._cache_argument: self.slots.cache})
        self.slots.set_length(past + q)

    @torch.inference_mode()
    def warm_up(self, slots: int | None = None, progress: bool = True) -> float:
        """Compile (or load) the runner's steps for ``slots`` KV slots (default: the first tier)
        before the first request; returns the seconds spent. Shows progress on stderr when asked."""
        if not self.compiled:
            return 0.0
        start = time.perf_counter()
        self.reset()
        self.slots.room(slots or self.slots.min_slots)
        sizes = self.runner.warm_up_rows()
        with _progress(progress) as bar:
            task = bar.add_task("compiling the forward", total=len(sizes))
            for rows in sizes:
                bar.update(task, description=self.runner.warm_up_description(rows))
                self.forward(torch.zeros(rows, dtype=torch.long))
                self.commit([0], rows)
                self.reset()
                if not self.compiled:
                    break
                bar.advance(task)
        return time.perf_counter() - start

    # ---- probes (``probes``): run once when the model is wrapped -------------------------
    def use_chains(self, own_mask: bool, why: str | None = None) -> None:
        """Verify one chain a step from now on: under the model's own causal mask (``own_mask``;
        it masks its own windows too) or under specfree's causal 4D mask. ``why``: the tree probe's
        finding, for ``describe``."""
        self.chain_only = True
        self.chain_mask = not own_mask
        self.verification = probes.CHAIN_OWN_MASK if own_mask else probes.CHAIN_CUSTOM_MASK
        self.why_chains = why
        if own_mask:
            self.sliding_window = self.layer_windows = None

    def describe(self) -> str:
        """How this adapter runs this model, for reports and the CLI."""
        if self.runner is None:
            return self.describe_verification()
        linears = "specfree's few-row kernel" if self.linears != "library" else "torch's"
        weights = ", weights shared with the model" if self.runner.options["weights"] == "shared" else ""
        return f"{self.runner.describe()}, linear layers {linears} ({self.linears}){weights}"

    def describe_verification(self) -> str:
        """How this adapter verifies drafts on this model (the probes' choice, and why not trees)."""
        text = f"{self.family}: verifies {probes.MODES[self.verification]}"
        if self.max_chain == 0:
            text += " (one row a step: the forward cannot continue its state over several tokens)"
        elif not self.keeps_cache:
            text += ", the whole sequence run again each step (the model keeps no KV cache)"
        elif self.why_chains:
            text += f" (no draft trees: it {self.why_chains})"
        return text

    def check_causal(self) -> None:
        probes.check_causal(self)

    def check_chain(self) -> None:
        probes.check_chain(self)

    def check_tree_mask(self) -> None:
        """Refuse, by name, a model that silently ignores a custom 4D mask or position ids."""
        failure = probes.tree_mask_failure(self)
        if failure is not None:
            raise UnsupportedModelError(f"model family '{self.family}' {failure}. Load it with "
                                        "attn_implementation='sdpa' or 'eager', or use another model family.")

    def _close(self, ours: torch.Tensor, reference: torch.Tensor) -> bool:
        return probes.close(self, ours, reference)


def _progress(show: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True, disable=not show)

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
and roll their state back after the verdict (``recurrent``); ``chain_only`` tells the engine.
"""

from __future__ import annotations

import inspect
import time
import warnings
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from specfree.adapters import recurrent
from specfree.adapters.attention import use_grouped_sdpa
from specfree.adapters.norms import fuse_norms
from specfree.errors import UnsupportedModelError
from specfree.kernels import use_few_row_linears
from specfree.masks.tree import additive_mask


def context_limit(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


# Layer kinds one additive mask per kind can express (the names models use in ``layer_types``).
MASKABLE_LAYERS = {"full_attention", "sliding_attention"}


def layer_kinds(model) -> set[str]:
    """The layer kinds a model's config names (``layer_types``), empty where it names none."""
    return set(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or [])


def verifies_chains(model) -> bool:
    """Whether ``model`` verifies one chain per step instead of a tree: recurrent layers cannot
    branch, and layer kinds one mask per kind cannot express (chunked attention) take causal rows only."""
    return (recurrent.cache_kind(model) != "growing"
            or not layer_kinds(model) <= MASKABLE_LAYERS | {"dummy", "moe", "mlp"})


def ignores_custom_masks(attn_implementation: str | None) -> bool:
    """Flash-attention kernels take no arbitrary mask: tree rows would see their siblings."""
    return "flash" in str(attn_implementation or "")


class HFAdapter:
    name = "hf"

    def __init__(self, model: PreTrainedModel, check_tree_mask: bool = True, grouped_attention: bool = True,
                 linear_kernel: str = "few_row", cache_dir: str | None = None):
        """``linear_kernel``: ``"few_row"`` runs CPU linear layers through specfree's kernel
        (``specfree.kernels``; built once under ``cache_dir``, the library's where it cannot be),
        ``"library"`` keeps torch's ``F.linear``."""
        self.model = model.eval()
        self._embeddings = model.get_input_embeddings()
        config = model.config
        self.family = config.model_type
        self._use_maskable_attention()
        if grouped_attention:
            use_grouped_sdpa(model)  # same math, no per-step copy of the cache for masked rows
        self.kernel_linears = use_few_row_linears(model, linear_kernel, cache_dir)  # rows at one row's price
        fuse_norms(model)  # bit-identical, fewer dispatches per forward
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = context_limit(config)
        # Recurrent layers cannot branch, and layer kinds one mask per kind cannot express (chunked
        # attention) can still take causal rows: one chain per step (max_chain drafts, None: any).
        self.cache_kind = recurrent.cache_kind(model)
        kinds = layer_kinds(model)
        if "indexed_attention" in kinds:
            raise UnsupportedModelError(
                f"model family '{self.family}' runs sparse top-k attention (indexed_attention layers), whose "
                "logits in transformers depend on how the tokens are split between forwards, so specfree "
                "cannot reproduce generate's output. Use another model family.")
        self.chain_only = verifies_chains(model)
        # A chain's rows are causal: the model masks its own windows, over its own window layers.
        self.sliding_window, self.layer_windows = (None, None) if self.chain_only else self._attention_windows(config)
        self.max_chain: int | None = None
        self.rollback_s = 0.0  # the last commit's rollback time (chain-only models)
        self._step: tuple | None = None
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "past_key_values" if "past_key_values" in parameters else "cache_params"
        # Mamba-style models take no positions, and pass unknown arguments on to their kernels.
        self._takes_positions = "position_ids" in parameters or not self.chain_only
        self.reset()
        # Rollbacks re-run only the state-writing mixers where they can be found, else the whole model.
        self.replay = recurrent.MixerReplay.find(model, self.cache, lambda: self.prefill(torch.arange(3, 6))) \
            if self.cache_kind == "states" else None
        self.reset()
        if check_tree_mask:
            self.check_causal()
            if self.chain_only:
                self.check_chain()
            else:
                self.check_tree_mask()

    @property
    def device(self) -> torch.device:
        return self._embeddings.weight.device  # model.device scans the parameters: slow, several calls a step

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def past_len(self) -> int:
        return self.cache.get_seq_length() if self.cache_kind == "growing" else self._length

    def _use_maskable_attention(self) -> None:
        """Switch a flash-attention model to SDPA (or eager, for families without SDPA), which take
        the tree mask: same weights, same math."""
        current = self.model.config._attn_implementation
        if not ignores_custom_masks(current):
            return
        reasons = []
        for fallback in ("sdpa", "eager"):
            try:
                self.model.set_attn_implementation(fallback)
            except (ValueError, ImportError) as exc:  # the family lacks this implementation
                reasons.append(f"{fallback}: {exc}")
                continue
            if self.model.config._attn_implementation == fallback:
                warnings.warn(f"attn_implementation={current!r} cannot take specfree's tree attention mask; "
                              f"switched this model to {fallback!r}", stacklevel=3)
                return
            reasons.append(f"{fallback}: the model does not switch attention after loading")
        raise UnsupportedModelError(
            f"model family '{self.family}' runs {current!r}, which cannot take specfree's tree attention "
            f"mask, and could not be switched ({'; '.join(reasons)}). Load it with "
            "attn_implementation='sdpa' or 'eager'.")

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
        self.cache = recurrent.new_cache(self.model, self.cache_kind)
        self._length = 0  # tokens in the cache (recurrent layers have no sequence axis to read it from)
        self._step = None

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> None:
        """Cache the KV of ``ids`` [L] (a plain causal forward; its logits are not needed)."""
        if ids.numel() == 0:
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
        causal = allowed is None or (q == 1 or bool(torch.equal(allowed, torch.ones(q, q, dtype=torch.bool).tril())))
        windowed = self.window is not None and past + q > self.window
        mask = None
        if not causal or windowed:
            if allowed is None:
                allowed = torch.ones(q, q, dtype=torch.bool).tril()
            mask = self._mask(allowed, past, positions)
        if self.chain_only and self.cache_kind != "growing" and q > 1:  # one row is always kept whole
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
        inputs = dict(input_ids=tokens.to(self.device)[None], attention_mask=mask, use_cache=True,
                      logits_to_keep=logits_to_keep)
        inputs[self._cache_argument] = self.cache
        if self._takes_positions:
            inputs["position_ids"] = positions.to(self.device)[None]
        out = self.model(**inputs)
        if self.cache is None:  # a family that builds its own cache class in its forward
            self.cache = getattr(out, "past_key_values", None) or getattr(out, "cache_params", None)
        self._length += tokens.numel()
        return out.logits[0]

    @torch.inference_mode()
    def commit(self, keep: list[int], rows: int) -> None:
        """Keep the KV of this step's rows ``keep`` (ascending, keep[0] == 0), drop the rest.

        ``rows`` is how many rows the step's forward appended.
        """
        if self.chain_only and self.cache_kind != "growing":
            self._commit_chain(len(keep), rows)
            return
        past = self.past_len - rows
        n = len(keep)
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

    @contextmanager
    def _probing(self, what: str, fix: str):
        """Run a probe on an empty cache and leave it empty; a forward the family's code rejects
        refuses the model by name."""
        self.reset()
        try:
            yield
        except UnsupportedModelError:
            raise
        except Exception as exc:
            raise UnsupportedModelError(
                f"model family '{self.family}' cannot run {what} ({type(exc).__name__}: {exc}). {fix}") from exc
        finally:
            self.reset()

    @torch.inference_mode()
    def check_causal(self) -> None:
        """Refuse, by name, a model whose rows see the rows after them (an encoder loaded as a causal
        LM): a row's logits must not change when later tokens are appended."""
        ids = torch.arange(3, 8) % min(self.vocab_size, 1000)
        with self._probing("specfree's forward", "Use another model family."):
            whole = self._forward(ids, torch.arange(5), None)[:3]
            self.reset()
            first = self._forward(ids[:3], torch.arange(3), None)
        if not self._close(whole, first):
            raise UnsupportedModelError(
                f"model family '{self.family}' is not causal: a row's logits change when later tokens are "
                "appended (bidirectional attention, e.g. an encoder loaded with is_decoder=False), so "
                "speculative rows would see the future and give wrong output. Load it as a decoder "
                "(is_decoder=True) or use a causal model family.")

    def _close(self, ours: torch.Tensor, reference: torch.Tensor) -> bool:
        scale = reference.float().abs().max().clamp(min=1.0)
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        return bool(((ours.float() - reference.float()).abs().max() / scale) <= tol)

    @torch.inference_mode()
    def check_chain(self) -> None:
        """For a model with recurrent layers: a chain of rows after a cached prefix, and the state
        rolled back to part of it, must give the logits of one row at a time (what ``generate``
        runs). If the model's multi-row forward does not continue its state, drafts cannot be
        verified at all: every step is then one row (plain decoding), with a warning."""
        ids = torch.arange(3, 10) % min(self.vocab_size, 1000)  # prefix a b c, chain d e f, then g
        with self._probing("specfree's forward", "Use another model family."):
            whole = self._forward(ids[:7], torch.arange(7), None)[3:]
            self.reset()
            self.prefill(ids[:3])
            singles = []
            for i in range(3, 7):
                singles.append(self.forward(ids[i : i + 1])[-1])
                self.commit([0], rows=1)
            self.reset()
            self.prefill(ids[:3])
            chain = self.forward(ids[3:6])
            self.commit([0, 1], rows=3)  # reject f: the state goes back to after e
            after_rollback = self.forward(ids[5:7])  # f again, then g
        if not self._close(torch.stack(singles), whole):
            raise UnsupportedModelError(
                f"model family '{self.family}' does not keep its state in the cache specfree passes it "
                f"({self._cache_argument}): one token at a time after a cached prefix differs from a forward over "
                "the whole sequence. Use another model family.")
        if not self._close(chain, torch.stack(singles[:3])):
            self.max_chain = 0
            warnings.warn(f"model family '{self.family}': this transformers version's forward does not carry "
                          "the recurrent state through several new tokens at once, so drafts cannot be checked; "
                          "decoding one token per step (plain speed, same output)", stacklevel=3)
        elif not self._close(after_rollback, torch.stack(singles[2:4])):
            raise UnsupportedModelError(
                f"model family '{self.family}' keeps state that specfree cannot roll back (a rejected draft "
                "would change later output). Use another model family.")

    @torch.inference_mode()
    def check_tree_mask(self) -> None:
        """Refuse, by name, a model that silently ignores a custom 4D mask or position ids.

        Two sibling rows must not see each other: the second sibling's logits must equal a
        plain forward over its own prefix.
        """
        vocab = min(self.vocab_size, 1000)
        ids = torch.arange(3, 8) % vocab  # prefix a b c, root d, siblings e f
        prefix, root, e, f = ids[:3], ids[3:4], ids[4:5], ids[4:5] + 1
        with self._probing("specfree's tree attention", "Use attn_implementation='sdpa' or 'eager', "
                           "or another model family."):
            reference = self._forward(torch.cat([prefix, root, f]), torch.arange(5), None)[-1]
            self.reset()
            self.prefill(prefix)
            allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
            tree = self.forward(torch.cat([root, e, f]), allowed, torch.tensor([3, 4, 4]))[-1]
        if not self._close(tree, reference):
            raise UnsupportedModelError(
                f"model family '{self.family}' ignores custom 4D attention masks "
                f"(attn_implementation={self.model.config._attn_implementation!r}), so speculative "
                "rows would see each other and give wrong output. Load it with "
                "attn_implementation='sdpa' or 'eager', or use another model family.")

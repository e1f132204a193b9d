"""A GGUF file as a model whose linear layers hold the file's own codes: never a float32 copy.

transformers' GGUF support dequantizes every tensor to float32 (8x a Q4 file in memory). Here the
config, tokenizer and tensor names still come from transformers (its per-architecture maps and
tensor processors), but the weights are read straight from the file:

1. the model is built with empty weights (``accelerate.init_empty_weights``);
2. each linear weight of a type in ``kernels.gguf_blocks.GGUF_TYPES`` becomes its row's layer, a ``CodedLinear``
   from its blocks, its rows put in the order transformers' tensor processor gives them (found by
   running the processor on the row numbers: a pure row permutation such as Llama's q/k unpermute
   moves the codes; anything else dequantizes that tensor);
3. everything else (norms, biases, F32/F16/BF16 tensors, types without a kernel) is dequantized by
   ``gguf`` itself and processed as transformers does; a quantized tensor that runs dequantized is
   named in one warning line with its type;
4. an embedding held as codes decodes its looked-up rows from them (tied to the head, or owning
   its own codes).

Bytes are read with ``pread``, one tensor at a time, so the file's pages are not kept mapped: the
peak is the codes plus one tensor's unpacking. The decoded values equal ``gguf.quants.dequantize``
(what transformers loads) bit for bit, so greedy output equals transformers' model of the file.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specfree.building import with_supported_attention
from specfree.errors import ModelLoadError, cause
from specfree.files import write_atomic
from specfree.gguf_config import check_shapes, parameter_of, refuse_architecture
from specfree.gguf_layouts import tensor_processor
from specfree.kernels import available_memory
from specfree.kernels.codes import CodedEmbedding, CodedLinear, carries_embedding, carries_linear, from_blocks
from specfree.kernels.experts import EXPERT_PARAMETERS, ExpertCodes, carries_experts, row_routers, use_coded_experts
from specfree.kernels.gguf_blocks import GGUF_TYPES, block_codes
from specfree.kernels.panels import WidePanelLinear, is_conv1d
from specfree.stored_codes import StoredCodes

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
TENSOR_TABLE = "tensors.json"  # the file's table of tensors, in its cache entry


@dataclass
class GGUFHoldings:
    """What a loaded GGUF holds how: type names of the tensors held as codes (per group of layers)
    and the quantized tensors that run dequantized, with their types. ``describe()`` prints it."""

    file: str
    coded: dict[str, Counter] = field(default_factory=dict)  # group ("attn_q", "ffn_down", "output") -> types
    dequantized: dict[str, str] = field(default_factory=dict)  # tensor -> its type
    kept: dict[str, str] = field(default_factory=dict)  # tensor -> the model's own module class it stays in
    code_bytes: int = 0

    def add(self, name: str, qtype: str) -> None:
        group = name.split(".")[-2] if name.startswith("blk.") else name.rsplit(".", 1)[0]
        self.coded.setdefault(group, Counter())[qtype] += 1

    def summary(self) -> str:
        groups = "; ".join(f"{group} {'/'.join(sorted(types))}" for group, types in sorted(self.coded.items()))
        held = f"held as codes: {groups or 'none'} ({self.code_bytes / 1e6:.0f} MB)"
        if self.dequantized:
            listed = ", ".join(f"{name} ({qtype})" for name, qtype in list(self.dequantized.items())[:6])
            more = len(self.dequantized) - 6
            held += f"; run as float32: {listed}" + (f" and {more} more" if more > 0 else "")
        return held

    def as_dict(self) -> dict:
        return {"file": self.file, "coded": {g: dict(t) for g, t in self.coded.items()},
                "dequantized": dict(self.dequantized), "kept": dict(self.kept), "code_bytes": self.code_bytes}


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class GGUFWeights:
    """The tensors of one GGUF file, read one at a time (``pread``: nothing stays mapped). The table
    of tensors is read from ``table`` (a file in the cache entry named by the file's content) where
    it is there: ``gguf.GGUFReader`` parses every metadata field, the vocabulary too (seconds)."""

    def __init__(self, path: Path, table: Path | None = None):
        import gguf

        self.path = path
        try:
            saved = json.loads(table.read_text())
            self.architecture = saved["architecture"]
            self.tensors = [(name, gguf.GGMLQuantizationType(qtype), tuple(shape), offset, nbytes)
                            for name, qtype, shape, offset, nbytes in saved["tensors"]]
        except (AttributeError, OSError, ValueError, KeyError, TypeError):
            reader = gguf.GGUFReader(str(path))
            self.architecture = str(reader.fields["general.architecture"].contents())
            # (name, type, shape [rows..., columns] as torch orders it, file offset, bytes)
            self.tensors = [(t.name, t.tensor_type, tuple(int(s) for s in reversed(t.shape.tolist())),
                             int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
            del reader  # its memory map goes with it
        size = path.stat().st_size
        for name, _, _, offset, nbytes in self.tensors:
            if offset + nbytes > size:
                raise ModelLoadError(f"could not read GGUF file {path}: tensor {name} ends at byte {offset + nbytes} "
                                     f"but the file has {size} (truncated). Download it again")

    def save(self, table: Path) -> None:
        """Write the table of tensors for the next load (``__init__``'s ``table``)."""
        rows = [(name, int(qtype), list(shape), offset, nbytes) for name, qtype, shape, offset, nbytes in self.tensors]
        write_atomic(table, json.dumps({"architecture": self.architecture, "tensors": rows}))

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            view, done = memoryview(out), 0
            while done < nbytes:
                got = os.preadv(f.fileno(), [view[done:]], offset + done)
                if got <= 0:
                    raise ModelLoadError(f"could not read GGUF file {self.path}: it ends inside a tensor. "
                                         "Download it again")
                done += got
        return out


def _row_order(processor, name: str, rows: int, columns: int, mapping: dict) -> np.ndarray | None:
    """The order transformers' tensor processor puts ``rows`` rows of tensor ``name`` in, when all
    it does is reorder rows (identity: None); raises LookupError when it does more."""
    probe = np.broadcast_to(np.arange(rows, dtype=np.float64)[:, None], (rows, columns))  # no copy
    try:
        result = processor.process(weights=probe, name=name, tensor_key_mapping=mapping,
                                   parsed_parameters={"tensors": {}, "config": {}})
    except ValueError:  # a processor that reshapes the whole tensor (Bloom's fused heads): not rows alone
        raise LookupError(name) from None
    moved = np.asarray(result.weights)[:, :1] if np.ndim(result.weights) == 2 else np.asarray(result.weights)
    probe = probe[:, :1]
    if result.name != name or moved.shape != probe.shape or not np.array_equal(np.sort(moved[:, 0]), probe[:, 0]):
        raise LookupError(name)
    order = moved[:, 0].astype(np.int64)
    return None if np.array_equal(order, probe[:, 0]) else order


def _dequantized(weights: GGUFWeights, entry, processor, mapping: dict, fused: dict | None = None) -> torch.Tensor:
    """The tensor as float32, processed as transformers does. ``fused``: the parsed parameters a processor
    fills itself (MoE experts' tensors, several to one parameter)."""
    import gguf

    name, qtype, shape, offset, nbytes = entry
    values = np.asarray(gguf.quants.dequantize(weights.read(offset, nbytes), qtype)).reshape(shape)
    result = processor.process(weights=values, name=name, tensor_key_mapping=mapping,
                               parsed_parameters=fused if fused is not None else {"tensors": {}, "config": {}})
    return torch.from_numpy(np.ascontiguousarray(result.weights, dtype=np.float32))


def _transposes(processor, name: str, rows: int, columns: int, mapping: dict) -> bool:
    """Whether transformers' tensor processor only transposes tensor ``name`` (GPT-2's Conv1D weights)."""
    probe = np.broadcast_to(np.arange(rows, dtype=np.float64)[:, None], (rows, columns))
    moved = np.asarray(processor.process(weights=probe, name=name, tensor_key_mapping=mapping,
                                         parsed_parameters={"tensors": {}, "config": {}}).weights)
    return moved.shape == (columns, rows) and np.array_equal(moved[0], probe[:, 0])


def _coded(weights: GGUFWeights, entry, processor, mapping: dict, lanes: int, transposed: bool = False):
    """``Codes`` of a 2-D quantized tensor, rows in transformers' order, or None (no code format).
    ``transposed``: for a layer that holds the weight [K, N] (``Conv1D``), whose codes are the file's rows
    as they are, where the processor only transposes them."""
    name, qtype, shape, offset, nbytes = entry
    if qtype not in GGUF_TYPES or len(shape) != 2:
        return None
    if transposed:
        order = None
        if not _transposes(processor, name, *shape, mapping):
            return None
    else:
        try:
            order = _row_order(processor, name, *shape, mapping)
        except LookupError:
            return None
    blocks = block_codes(weights.read(offset, nbytes), qtype, *shape)
    if blocks is None:
        return None
    return from_blocks(blocks if order is None else blocks.rows(order), lanes)


def _sixteen_bits(weights: GGUFWeights, entry, processor, mapping: dict) -> torch.Tensor | None:
    """An F16 or BF16 2-D tensor as its own 16-bit values, rows in transformers' order, or None."""
    name, qtype, shape, offset, nbytes = entry
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(qtype.name)
    if dtype is None or len(shape) != 2:
        return None
    try:
        order = _row_order(processor, name, *shape, mapping)
    except LookupError:
        return None
    values = torch.from_numpy(weights.read(offset, nbytes)).view(dtype).reshape(shape)
    return values if order is None else values[torch.from_numpy(order)].contiguous()


def _expert_layers(weights: GGUFWeights, entry, lanes: int) -> list[nn.Module] | None:
    """One layer per expert of a 3-D experts tensor [experts, rows, columns]: ``CodedLinear`` from its
    blocks, ``WidePanelLinear`` from 16-bit values; None for other types (then it is dequantized)."""
    name, qtype, shape, offset, nbytes = entry
    if len(shape) != 3:
        return None
    count, rows, columns = shape
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(qtype.name)
    if dtype is not None:
        values = torch.from_numpy(weights.read(offset, nbytes)).view(dtype).reshape(shape)
        return [WidePanelLinear(values[e].clone(), None, lanes) for e in range(count)]
    if qtype not in GGUF_TYPES:
        return None
    blocks = block_codes(weights.read(offset, nbytes), qtype, count * rows, columns)
    if blocks is None:
        return None
    source = nn.Linear(columns, rows, bias=False, device="meta")
    row = GGUF_TYPES[qtype]
    return [row.hold(source, from_blocks(blocks.rows(np.arange(e * rows, (e + 1) * rows)), lanes))
            for e in range(count)]


def _hold_experts(module: nn.Module, entries: list, weights: GGUFWeights, processor, mapping: dict, lanes: int,
                  holdings: GGUFHoldings, fused: dict) -> bool:
    """An experts module's three file tensors (gate, up, down) as its ``specfree_codes``; True if held so.
    A type without a code format leaves all three to the processor (dequantized into ``fused``)."""
    layers = {entry[0]: _expert_layers(weights, entry, lanes) for entry in entries}
    if len(entries) != 3 or any(found is None for found in layers.values()):
        for name, qtype, *_ in entries:
            if qtype.name not in FLOAT_TYPES:
                holdings.dequantized[name] = qtype.name
        for entry in entries:
            _dequantized(weights, entry, processor, mapping, fused)
        return False
    held = {re.search(r"ffn_(gate|up|down)_exps", name)[1]: found for name, found in layers.items()}
    module.specfree_codes = ExpertCodes(held["gate"], held["up"], held["down"])
    for key in EXPERT_PARAMETERS:
        del module._parameters[key]
    for name, qtype, *_ in entries:
        if qtype.name not in FLOAT_TYPES:
            holdings.add(name, qtype.name)
            holdings.code_bytes += sum(layer.coded.nbytes() for layer in layers[name])
    return True


def estimate_bytes(weights: GGUFWeights) -> int:
    """The memory the model will take: codes at their kernel format's size, 16-bit weights at 2
    bytes, the rest as float32."""
    total = 0
    for _, qtype, shape, _, nbytes in weights.tensors:
        numel = int(np.prod(shape))
        row = GGUF_TYPES.get(qtype)
        bits = (row.held_bits if row else 16 if qtype.name in ("F16", "BF16") else 32) if len(shape) == 2 else 32
        total += int(numel * bits / 8)
    return total


def gguf_names(model: nn.Module, processor, architecture: str) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, by ``gguf``'s name map for the file's
    architecture: what transformers' ``get_gguf_hf_weights_map`` computes (a name unmapped at the
    top is tried without its leading module names, as it tries each submodule), with the map built
    once rather than once per submodule (13 s for SmolLM2's 397 modules)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ModelLoadError(f"the gguf package does not know the architecture {architecture!r}: upgrade gguf")
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)
    mapping: dict[str, str] = {}
    for full in model.state_dict(keep_vars=True):
        parts = full.split(".")
        for start in range(len(parts) - 1):
            hf_name = processor.preprocess_name(".".join(parts[start:]))
            name, dot, suffix = hf_name.rpartition(".") if hf_name.endswith((".weight", ".bias")) else (hf_name, "", "")
            gguf_name = name_map.get_name(name)
            if gguf_name is not None:
                mapping.setdefault(gguf_name + dot + suffix, full)
                break
        else:  # a fused parameter (MoE experts' gate_up_proj): keys without a suffix, as transformers makes them
            suffix = "." + full.rpartition(".")[2] if full.endswith((".weight", ".bias")) else ""
            processor.perform_fallback_tensor_mapping(mapping, suffix, "", full)
    return mapping


def load_coded(path: Path, config, lanes: int, attn_implementation: str | None = "sdpa", table: Path | None = None):
    """The causal LM of GGUF ``path`` (``config``: its transformers config), linear layers held as
    the file's codes in panels of ``lanes`` columns; with a ``GGUFHoldings`` at ``model.gguf_holdings``.
    ``table``: where the file's table of tensors is cached (``GGUFWeights``); the layers' repacked codes
    are kept beside it (``StoredCodes``)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    weights = GGUFWeights(path, table)
    refuse_architecture(weights.architecture, path)
    need, free = estimate_bytes(weights), available_memory()
    if free is not None and need > free:
        raise ModelLoadError(f"could not load {path}: it needs about {need / 2**30:.1f} GiB of memory "
                             f"(its codes, and float32 for tensors without a kernel) and {free / 2**30:.1f} GiB "
                             "is available. Free memory, or use a smaller or more quantized file")
    try:  # a failure here is transformers' model of the architecture, not the file: say so
        with init_empty_weights():
            model = with_supported_attention(
                lambda attention: AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                                   dtype=torch.float32), attn_implementation)
    except Exception as exc:
        import transformers

        raise ModelLoadError(f"could not build the {config.model_type} model of {path.name} (its metadata was read): "
                             f"transformers {transformers.__version__} says {cause(exc)}. The file is not at fault: "
                             "try another transformers version, or give the model's transformers folder") from exc
    processor = tensor_processor(weights.architecture, config)
    mapping = gguf_names(model, processor, weights.architecture)
    check_shapes(model, weights, mapping, path)
    holdings = GGUFHoldings(path.name)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and getattr(config, "tie_word_embeddings", False)
    embedding_codes = None
    head_if_tied = head if tied else None
    stored = StoredCodes(None if table is None else table.parent, lanes)
    fused: dict = {"tensors": {}, "config": {}}  # parameters the processor builds from several tensors
    experts: dict[str, list] = {}  # an experts module -> its file tensors (gate, up, down)
    with torch.no_grad():
        for entry in weights.tensors:
            name, qtype = entry[0], entry[1]
            hf_name = parameter_of(mapping, name)
            if hf_name is None:
                continue
            module_name, _, key = hf_name.rpartition(".")
            if key in EXPERT_PARAMETERS and carries_experts(model.get_submodule(module_name)):
                experts.setdefault(module_name, []).append(entry)
                continue
            if not hf_name.endswith((".weight", ".bias")):  # MoE experts (the processor fuses them), Mamba's A, D
                if qtype.name not in FLOAT_TYPES:
                    holdings.dequantized[name] = qtype.name
                tensor = _dequantized(weights, entry, processor, mapping, fused)
                fused["tensors"].setdefault(hf_name, tensor)
                continue
            module = model.get_submodule(module_name)
            codes = None
            if key == "weight" and carries_linear(module) and module is not head_if_tied:
                narrow = _sixteen_bits(weights, entry, processor, mapping)
                if narrow is not None:  # float32 computed on the file's 16-bit values
                    _replace(model, module_name, WidePanelLinear(narrow, module.bias, lanes))
                    continue
            if key == "weight" and (carries_linear(module) or (module is embedding and carries_embedding(module))):
                codes = stored.get(name, lambda: _coded(weights, entry, processor, mapping, lanes))
            elif key == "weight" and is_conv1d(module):
                codes = stored.get(name, lambda: _coded(weights, entry, processor, mapping, lanes, transposed=True))
            if codes is not None:
                holdings.add(name, qtype.name)
                holdings.code_bytes += codes.nbytes()
                if module is embedding:
                    embedding_codes, embedding_type = codes, GGUF_TYPES[qtype]
                else:
                    _replace(model, module_name, GGUF_TYPES[qtype].hold(module, codes, is_conv1d(module)))
                continue
            if qtype.name not in FLOAT_TYPES:
                holdings.dequantized[name] = qtype.name
                if module is embedding:
                    holdings.kept[name] = type(module).__name__
            tensor = _dequantized(weights, entry, processor, mapping)
            target = getattr(module, key)
            module._parameters[key] = _parameter(tensor.reshape(target.shape))
        coded_experts = any([_hold_experts(model.get_submodule(name), entries, weights, processor, mapping, lanes,
                                           holdings, fused) for name, entries in experts.items()])
        if coded_experts:
            use_coded_experts(model)
        for hf_name, tensor in fused["tensors"].items():
            module_name, _, key = hf_name.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[key] = _parameter(tensor.float().reshape(getattr(module, key).shape))
        if embedding_codes is not None:
            source = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
            table = embedding_type.hold(source, embedding_codes)
            if tied and not _has_tensor(model, head):
                _replace(model, _name_of(model, head), table)
                _replace(model, _name_of(model, embedding), CodedEmbedding(embedding, table))
            else:
                _replace(model, _name_of(model, embedding), CodedEmbedding(embedding, table, own=True))
        elif tied and not _has_tensor(model, head):
            model.tie_weights()
    if coded_experts:
        row_routers(model, lanes)  # after the routers' weights are read
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta"]
    if missing:
        raise ModelLoadError(f"could not load {path}: the file lacks {len(missing)} tensor(s) the "
                             f"{config.model_type} model needs ({', '.join(missing[:3])}). Download it again")
    for name, cls in holdings.kept.items():
        warnings.warn(f"{path.name}: the input embedding ({cls}) computes more than a lookup, which specfree's "
                      f"coded embedding does not carry: {name} stays in {cls}, dequantized as float32", stacklevel=3)
    if holdings.dequantized.keys() - holdings.kept.keys():
        warnings.warn(f"{path.name}: {holdings.summary().split('; run as float32: ')[1]} have no kernel "
                      "here and run dequantized as float32", stacklevel=3)
    stored.save()
    model.gguf_holdings = holdings
    return model.eval()


def _has_tensor(model: nn.Module, module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(module, CodedLinear) or (weight is not None and weight.device.type != "meta")


def _name_of(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is target)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)

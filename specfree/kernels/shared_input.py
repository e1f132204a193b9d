"""One coded call for sibling layers that read the same input: q, k and v; gate and up.

A transformers attention calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` one after another, and
its MLP ``gate_proj(x)`` and ``up_proj(x)``: five of a Llama layer's seven products, each a call of
its own, with its own start-up (threads woken, activations quantized at int8) over a small matrix.
Here the siblings' codes are concatenated along their outputs into one tensor per field, each
layer's own codes become views of it (no second copy), and the first sibling asked computes every
sibling's columns in one ``specfree::coded_linear`` call; the others take their columns from it.

Bits: the kernel computes each output column from that column's codes and the input row alone,
whatever the other columns of the call (``panel_linear.cpp``), so a column of the shared call is
the column its own layer computes. Without touching the model's code the siblings cannot be told
apart from other callers, so a sibling only takes a shared result for the very tensor it was
computed from, once; asked with any other input (another caller, a second call), it computes its
own columns alone, as an unshared layer does.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from specfree.kernels.codes import CodedLinear, Codes
from specfree.kernels.swap import swapped_modules

# Sibling layers that transformers' models call on one input, by their attribute names.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
SHARED = tuple(f"shared_{key}" for key in Codes.FIELDS) + ("shared_bias",)  # the first sibling's extra buffers


class SharedCall:
    """The call a group of sibling layers shares, and the last result until each took its columns.

    Not a module: the shared tensors are buffers of the first sibling (so ``named_buffers`` and an
    exported step find them once), and each sibling holds this object outside its submodules."""

    def __init__(self, members: list[SharingLinear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self._forget()

    @property
    def codes(self) -> Codes:
        """The siblings' codes as one layer's, outputs after outputs."""
        held = self.members[0]._buffers
        return Codes(*(held[key] for key in SHARED[:-1]))

    @property
    def bias(self) -> torch.Tensor | None:
        return self.members[0]._buffers["shared_bias"]

    def _forget(self) -> None:
        self._input: torch.Tensor | None = None
        self._key: tuple | None = None
        self._outputs: list[torch.Tensor] = []
        self._untaken: set[int] = set()

    def output(self, slot: int, x: torch.Tensor, precision: str) -> torch.Tensor:
        """Sibling ``slot``'s product of ``x``: from the shared call of ``x`` where it has not taken it yet."""
        key = (precision, None if x.is_inference() else x._version)  # an in-place change is another input
        if self._input is not x or self._key != key or slot not in self._untaken:
            y = self.codes.linear(x, self.bias, sum(self.sizes), "auto", precision)
            # contiguous, as each layer's own call returns (a split of several rows is strided)
            self._outputs = [part.contiguous() for part in y.split(self.sizes, dim=-1)]
            self._input, self._key, self._untaken = x, key, set(range(len(self.sizes)))
        self._untaken.discard(slot)
        out = self._outputs[slot]
        if not self._untaken:  # every sibling has its columns: hold no tensors between calls
            self._forget()
        return out

    def __deepcopy__(self, memo):  # a copy of the model (shared_parameter_copy) gets its own, empty
        twin = SharedCall.__new__(SharedCall)
        memo[id(self)] = twin
        twin.members = [copy.deepcopy(m, memo) for m in self.members]
        twin.sizes = list(self.sizes)
        twin._forget()
        return twin


class SharingLinear(CodedLinear):
    """A ``CodedLinear`` whose codes are a view of its siblings' shared tensors; its product comes
    from their shared call (``SharedCall``). Everything else (weight, state dict, precision,
    ``to_linear``) is its own layer's."""

    def __init__(self, layer: CodedLinear, codes: Codes, bias: torch.Tensor | None, slot: int):
        nn.Module.__init__(self)
        self.out_features, self.in_features = layer.out_features, layer.in_features
        self.precision, self.block_type = layer.precision, layer.block_type
        self._hold(codes)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        self.slot = slot
        self.__dict__["call"] = None  # the SharedCall, outside the module tree: every sibling holds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.__dict__["call"].output(self.slot, x, self.precision)

    def _load_weight(self, weight: torch.Tensor, prefix: str, error_msgs: list[str]) -> bool:
        # new codes are written into the views, so the shared tensors hold them too
        views = self.coded
        if not super()._load_weight(weight, prefix, error_msgs):
            return False
        loaded = self.coded
        if any((v is None) != (t is None) or (v is not None and (v.shape != t.shape or v.dtype != t.dtype))
               for v, t in zip(views.tensors(), loaded.tensors())):
            error_msgs.append(f"{prefix}weight codes as another format than its siblings' shared call holds; "
                              "load it into a model prepared with linear_kernel=few_row_fp32")
            self._hold(views)
            return False
        with torch.no_grad():
            for v, t in zip(views.tensors(), loaded.tensors()):
                if v is not None:
                    v.copy_(t)
        self._hold(views)
        return True


def _shareable(layers: list[nn.Module]) -> bool:
    """Whether one call computes these layers' columns: the same type, input width, format and
    precision, biases alike, and every panel but the last one's full (columns line up)."""
    if not all(type(m) is CodedLinear for m in layers):
        return False
    first = layers[0]
    lanes = first.codes.shape[2]

    def form(m: CodedLinear) -> tuple:
        return (m.in_features, m.precision, m.block_type, m.bias is None,
                *((None,) if t is None else (t.dtype, t.shape[1:]) for t in m.coded.tensors()),
                None if m.bias is None else m.bias.dtype)

    return (all(form(m) == form(first) for m in layers)
            and all(m.out_features % lanes == 0 for m in layers[:-1]))


def concatenated(layers: list[CodedLinear]) -> tuple[Codes, torch.Tensor | None]:
    """The layers' codes as one layer's, outputs after outputs, and their biases (None: none)."""
    fields = [None if getattr(layers[0].coded, key) is None else torch.cat([getattr(m.coded, key) for m in layers])
              for key in Codes.FIELDS]
    bias = None if layers[0].bias is None else torch.cat([m.bias.detach() for m in layers])
    return Codes(*fields), bias


def share(layers: list[CodedLinear]) -> list[SharingLinear]:
    """The layers as siblings of one shared call, their codes and biases moved into its tensors
    (each layer's a view: loading a state dict writes into them)."""
    shared, bias = concatenated(layers)
    members, start, column = [], 0, 0
    for slot, layer in enumerate(layers):
        count = layer.codes.shape[0]  # panels
        own = Codes(*(None if t is None else t[start : start + count] for t in shared.tensors()))
        members.append(SharingLinear(layer, own, None if bias is None else bias[column : column + layer.out_features],
                                     slot))
        start, column = start + count, column + layer.out_features
    call = SharedCall(members)
    for member in members:
        member.__dict__["call"] = call
    for key, tensor in zip(SHARED, (*shared.tensors(), bias)):
        members[0].register_buffer(key, tensor, persistent=False)
    return members


def share_inputs(model: nn.Module) -> int:
    """Give every group of ``SIBLINGS`` held as codes of one format one shared call; returns how many
    groups. Groups already sharing are left as they are."""
    groups = 0
    for parent in list(model.modules()):
        children = parent._modules
        for names in SIBLINGS:
            layers = [children.get(name) for name in names]
            if any(m is None for m in layers) or not _shareable(layers):
                continue
            for name, member in zip(names, share(layers)):
                setattr(parent, name, member)
            groups += 1
    return groups


def _alone(module: nn.Module) -> CodedLinear | None:
    if not isinstance(module, SharingLinear):
        return None
    layer = CodedLinear.__new__(CodedLinear)
    nn.Module.__init__(layer)
    layer.out_features, layer.in_features = module.out_features, module.in_features
    layer.precision, layer.block_type = module.precision, module.block_type
    layer._hold(module.coded)
    layer.register_parameter("bias", module.bias)
    return layer


@contextlib.contextmanager
def separate_calls(model: nn.Module):
    """Each sibling its own call again inside the block (over the same tensors), shared after it:
    what sharing saves, measured."""
    with swapped_modules(model, _alone):
        yield model

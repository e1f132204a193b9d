"""The C entries (``c_entries.h``) of the ops a compiled step calls most, declared for Inductor.

An AOTInductor package calls an op with a C entry as a plain function; any other custom op goes
through the package's proxy executor, which boxes every argument and dispatches the op by name on
every call. A package built with them names the entries as undefined symbols: ``load_kernels``
makes the library's symbols global, so the package finds them when it is loaded.
"""

from __future__ import annotations

import torch

ENTRIES = ("coded_linear", "rms_norm_rows", "activation", "tree_attention")  # each defined in its op's source

# An argument's C type as Inductor's C++ wrapper passes it, by its schema type.
C_TYPES = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*", "int": "int64_t", "float": "double",
           "str": "const char*"}


def declaration(op) -> str:
    """The C signature of ``op``'s entry (an ``OpOverload`` returning one tensor): its schema's
    arguments in order, then a pointer to the returned tensor's handle; the name Inductor calls,
    ``aoti_torch_cpu_NAME``."""
    schema = op._schema
    # real_type: a ScalarType argument's type is int, which Inductor passes as a 32-bit enum
    unknown = [f"{a.name}: {a.real_type}" for a in schema.arguments if str(a.real_type) not in C_TYPES]
    if unknown or [str(r.type) for r in schema.returns] != ["Tensor"]:
        raise TypeError(f"{schema.name} has no C entry form for {', '.join(unknown) or 'its returns'}")
    arguments = [f"{C_TYPES[str(a.real_type)]} {a.name}" for a in schema.arguments] + ["AtenTensorHandle* out"]
    return f"AOTITorchError aoti_torch_cpu_{schema.name.split('::')[-1]}({', '.join(arguments)})"


def c_shims() -> dict:
    """Inductor's ``aot_inductor.custom_ops_to_c_shims``: each loaded op with a C entry, its declaration."""
    ops = getattr(torch.ops, "specfree", None)
    loaded = [getattr(ops, name).default for name in ENTRIES if ops is not None and hasattr(ops, name)]
    return {op: [declaration(op)] for op in loaded}

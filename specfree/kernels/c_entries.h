// C entries of specfree's ops, which AOTInductor packages call directly (declared for Inductor in
// specfree/kernels/c_shims.py). A package calls an op without one through its proxy executor, which
// boxes every argument into a stack and dispatches the op by name on every call: several times the
// work of a small op itself, two hundred times a step.
#pragma once

#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <optional>
#include <utility>

// An entry's C name is the one Inductor calls for op specfree::NAME on the CPU: aoti_torch_cpu_NAME.
#define SPECFREE_C_ENTRY extern "C" __attribute__((visibility("default"))) AOTITorchError

namespace specfree {

inline const at::Tensor& tensor_of(AtenTensorHandle handle) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
}

inline std::optional<at::Tensor> optional_of(AtenTensorHandle* handle) {  // None: a null pointer
  return handle ? std::make_optional(tensor_of(*handle)) : std::nullopt;
}

inline void hand_back(at::Tensor tensor, AtenTensorHandle* out) {
  *out = torch::aot_inductor::new_tensor_handle(std::move(tensor));
}

}  // namespace specfree

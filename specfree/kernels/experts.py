"""A mixture-of-experts layer's experts held as a GGUF's codes, one ``CodedLinear`` per expert and
projection, run through transformers' own extension point for experts (``ExpertsInterface``).

A GGUF stores each layer's experts as 3-D tensors (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``: [experts, rows, columns]); transformers fuses gate and up into one float32
parameter. Here each expert's rows become ``CodedLinear`` layers, and ``coded_experts_forward`` runs
the experts module's own eager algorithm over them: for each expert some row is routed to, in
expert order, its rows' gate and up products, the module's own gating, the down product, the
routing weight, and an index-add into the output. Only the routed experts' codes are read, and since
``coded_linear`` gives a row the same bits whatever other rows share the call, and every other step
is row-wise in a fixed order, a verify row equals the one-row forward bit for bit: the dense models'
guarantee, which transformers' grouped or per-expert matmuls over a varying number of rows do not give.
"""

from __future__ import annotations

import torch
from torch import nn

CODED_EXPERTS = "specfree_coded_experts"
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # the experts module's parameters the file's tensors fill
# Experts classes whose eager forward ``coded_experts_forward`` reproduces (read in transformers 5.23-5.24):
# concatenated gate and up, no bias, no transposed weights, no norm after each expert.
CARRIED_EXPERTS = ("Qwen2MoeExperts", "Qwen3MoeExperts")


def carries_experts(module: nn.Module) -> bool:
    return (type(module).__name__ in CARRIED_EXPERTS and getattr(module, "is_concatenated", True)
            and not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
            and getattr(module, "has_gate", True) and not getattr(module, "has_post_expert_norm", False))


class ExpertCodes(nn.Module):
    """Each expert's gate, up and down projections as ``CodedLinear`` (or 16-bit ``WidePanelLinear``) layers."""

    def __init__(self, gate: list[nn.Module], up: list[nn.Module], down: list[nn.Module]):
        super().__init__()
        self.gate, self.up, self.down = nn.ModuleList(gate), nn.ModuleList(up), nn.ModuleList(down)


def coded_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's eager forward over its ``specfree_codes``. hidden_states [T, H];
    top_k_index, top_k_weights [T, k] -> [T, H]."""
    codes: ExpertCodes = module.specfree_codes
    experts = len(codes.gate)
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        routed = torch.nn.functional.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)  # [E+1, k, T]
        hit = torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit[:, 0].tolist():
        if expert == experts:
            continue
        top_k_pos, token_idx = torch.where(routed[expert])
        rows = hidden_states[token_idx]
        gate_up = torch.cat([codes.gate[expert](rows), codes.up[expert](rows)], dim=-1)  # as the fused product
        out = codes.down[expert](module._apply_gate(gate_up))
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


class RowRouter(nn.Module):
    """A Qwen2/3-MoE top-k router (``CARRIED_ROUTERS``: their forward as read in transformers 5.23-5.24)
    whose logits come from a row-invariant linear (``linear``: panels or codes) rather than a BLAS call,
    whose bits change with the number of rows: the routing, and so every expert's weight, is then the
    same for a verify row as for the one-row forward."""

    def __init__(self, router: nn.Module, linear: nn.Module):
        super().__init__()
        self.top_k, self.num_experts = router.top_k, router.num_experts
        self.norm_topk_prob, self.hidden_dim = router.norm_topk_prob, router.hidden_dim
        self.linear = linear

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = self.linear(hidden_states)  # [T, E]
        router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value.to(router_logits.dtype), router_indices


CARRIED_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")


def row_routers(model: nn.Module, lanes: int) -> int:
    """Replace each carried router by a ``RowRouter`` over float32 panels of its weight; returns how many."""
    from specfree.kernels.panels import PanelLinear
    from specfree.kernels.swap import swap_modules

    def convert(module: nn.Module):
        if type(module).__name__ not in CARRIED_ROUTERS:
            return None
        source = nn.Linear(module.hidden_dim, module.num_experts, bias=False, device="meta")
        source.weight = module.weight
        return RowRouter(module, PanelLinear(source, lanes))

    return swap_modules(model, convert)


def use_coded_experts(model: nn.Module) -> None:
    """Register ``coded_experts_forward`` with transformers and switch ``model``'s experts to it."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(CODED_EXPERTS, coded_experts_forward)
    model.set_experts_implementation(CODED_EXPERTS)

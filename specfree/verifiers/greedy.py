"""Greedy verification: emit the argmax at each node, descend while a child carries it."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from specfree.logits import greedy_ids
from specfree.draft_tree import DraftTree
from specfree.types import Verdict


class GreedyVerifier:
    name = "greedy"
    do_sample = False

    def __init__(self, processors: LogitsProcessorList | None = None):
        # Processors matter in greedy too (a repetition penalty changes the argmax).
        self.processors = processors or LogitsProcessorList()

    def verify(self, logits: torch.Tensor, tree: DraftTree, context: torch.Tensor) -> Verdict:
        """logits: [T, V] for the tree rows; context: [L] committed ids ending with the root."""
        if not self.processors:
            preds = greedy_ids(logits)  # one pass over the whole tree
            pick = lambda node, prefix: preds[node]  # noqa: E731
        elif len(self.processors) == 1 and hasattr(self.processors[0], "argmax") and logits.device.type == "cpu":
            mask, rows = self.processors[0], logits.detach().float().numpy()  # a constraint's mask alone
            pick = lambda node, prefix: mask.argmax(prefix[None], rows[node])  # noqa: E731
        else:
            context = context.to(logits.device)  # processors index the scores with these ids
            pick = lambda node, prefix: int(  # noqa: E731
                self.processors(prefix[None], logits[node : node + 1].float())[0].argmax())
        return walk(tree, context, pick)


def walk(tree: DraftTree, context: torch.Tensor, pick) -> Verdict:
    """Descend from the root: at each node ``pick`` the model's token; stop when no child has it."""
    node, tokens, path = 0, [], []
    prefix = context
    while True:
        token = pick(node, prefix)
        tokens.append(token)
        child = tree.children.get((node, token))
        if child is None:
            return Verdict(tokens=tokens, path=path)
        path.append(child)
        node = child
        prefix = torch.cat([prefix, prefix.new_tensor([token])])

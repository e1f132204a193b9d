"""Structured output: a request's JSON schema, regex or grammar, enforced losslessly by masking
the verifier's logits at every node it walks (docs/structured-output.md)."""

from specfree.constraints.compiler import Grammars
from specfree.constraints.matcher import ConstraintError, ConstraintMask, Matcher, masked, prune
from specfree.constraints.spec import KINDS, OPTIONS, Constraint, per_prompt, read_option

__all__ = ["KINDS", "OPTIONS", "Constraint", "ConstraintError", "ConstraintMask", "Grammars", "Matcher", "masked", "per_prompt", "prune", "read_option"]

"""Structured output: a request's JSON schema, regex or grammar, enforced losslessly by masking
the verifier's logits at every node it walks (docs/structured-output.md)."""

from specfree.constraints.compiler import Grammars
from specfree.constraints.matcher import ConstraintError, ConstraintMask, Matcher, masked, prune
from specfree.constraints.spec import KINDS, Constraint, read_option

__all__ = ["KINDS", "Constraint", "ConstraintError", "ConstraintMask", "Grammars", "Matcher", "masked", "prune", "read_option"]

"""The baseline: no drafts, one token per forward."""

from specfree.strategies.base import Strategy


class Autoregressive(Strategy):
    name = "autoregressive"

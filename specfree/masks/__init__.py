"""Mask builders: turn a draft tree (+ auxiliary rows) into attention masks and position ids."""

from specfree.masks.tree import Layout, ancestors, build_layout

__all__ = ["Layout", "ancestors", "build_layout"]

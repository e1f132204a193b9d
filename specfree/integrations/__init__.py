"""Bridges from other libraries' entry points to specfree's engine."""

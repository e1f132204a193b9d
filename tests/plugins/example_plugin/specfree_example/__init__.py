"""An example specfree plugin (see plugin.py)."""

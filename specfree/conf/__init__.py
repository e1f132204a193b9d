"""The packaged Hydra configs (``config.yaml`` and its groups); a package so Hydra can find them
with ``pkg://specfree.conf`` in any install, wheel or editable."""

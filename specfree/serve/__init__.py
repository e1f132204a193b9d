"""``python -m specfree serve``: an OpenAI-compatible server over one engine (docs/serve.md).

Needs the ``serve`` extra (``pip install "specfree[serve]"``: fastapi, uvicorn, prometheus-client).
"""

from __future__ import annotations


def create_app(*args, **kwargs):
    """See ``specfree.serve.app.create_app`` (imported on use: fastapi is an optional extra)."""
    from specfree.serve.app import create_app as make

    return make(*args, **kwargs)


__all__ = ["create_app"]

"""Fixtures shared across test modules. Keep each group in its own section."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import EXAMPLE_PLUGIN, write_dist_info


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="device of the tiny models (tests/tiny_models.py), e.g. cuda: the lossless tests on a GPU")


def pytest_configure(config):
    if config.getoption("device") != "cpu":
        from tests import tiny_models

        tiny_models.DEVICE = config.getoption("device")


# ---- tiny-model property tests (test_fuzz.py, test_lookahead.py, test_lossless.py, ...) --------------------------
@pytest.fixture
def quiet_families():
    """Tiny models of every family: transformers' own notices (slow reference kernels, ...) and
    specfree's UserWarnings about a family's limits are not what these tests check."""
    import warnings

    import transformers

    transformers.utils.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine lose a lot to them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def datastore(tmp_path_factory) -> str:
    """A tiny retrieval datastore over two short English texts (test_lossless, test_recurrent,
    test_chain_families)."""
    import json

    from specfree.datastore import build_datastore
    from tests.tiny_models import tiny_tokenizer

    folder = tmp_path_factory.mktemp("ds")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in [
        "the cat sat on the red car and the dog ran to the big house",
        "one two three four five six seven eight nine ten"]))
    build_datastore([corpus], tiny_tokenizer(), folder / "store.sfds")
    return str(folder / "store.sfds")


# ---- CLI, configs and plugins (test_cli.py, test_configs.py, test_plugins.py) ---------------
@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama and its word-level tokenizer (with a chat template), saved as a folder,
    so tests run the real loading path with ``model=local model.path=<this folder>``."""
    from tests.tiny_models import tiny_model, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def example_plugin_paths(tmp_path_factory) -> list[str]:
    """sys.path entries under which the example plugin counts as installed (its entry point
    ``specfree: example``), without pip: the dist-info folder and the plugin's source."""
    site = tmp_path_factory.mktemp("site")
    write_dist_info(site, "specfree-example-plugin", "0.1.0", {"example": "specfree_example.plugin"})
    return [str(site), str(EXAMPLE_PLUGIN)]

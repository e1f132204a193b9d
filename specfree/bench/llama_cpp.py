"""llama.cpp as ``bench`` baselines, through llama-cpp-python (the optional extra ``specfree[llama-cpp]``).

``llama_cpp`` is its plain decoding loop, ``llama_cpp_lookup`` the same loop with llama-cpp-python's
prompt-lookup draft model (``LlamaPromptLookupDecoding``). llama-cpp-python exposes no lookahead
decoding (llama.cpp has it only as the ``llama-lookahead`` example program), so there is no such row.

Each runs on the GGUF the model came from (SmolLM2 ships as Q4_1) and on a GGUF made from it at the
run's precision (F32 for ``dtype=float32``, made once and cached), so one pair of rows compares like
with like and the other shows what quantized weights buy. The row's label names the weights:
``llama_cpp[F32]``, ``llama_cpp_lookup[Q4_1]``. Every row is fed the token ids specfree encodes
(the chat template applied once, by specfree), decodes greedily and stops at the same EOS ids. Its
kernels differ from torch's, so its greedy output may leave specfree's after a near tie: its
``identical`` column counts the prompts that agree, it is not a lossless baseline.

Nothing here imports ``llama_cpp`` until these rows are asked for and can run.
"""

from __future__ import annotations

import importlib
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specfree.bench.systems import LLAMA_CPP_BASELINES as BASELINES
from specfree.bench.systems import Turn, check_listed_once, describe
from specfree.conf.schema import DEFAULT_BASELINES
from specfree.errors import ConfigError, check_int
from specfree.files import atomic_path, file_digest, fingerprint, remember_digest

INSTALL = 'pip install "specfree[llama-cpp]"'
BUILD_NOTE = "it builds llama.cpp from source"
# The knobs each row takes, with their defaults (the issue ran llama-lookup with --draft-max 10).
KNOBS: dict[str, dict[str, int]] = {"llama_cpp": {}, "llama_cpp_lookup": {"num_pred_tokens": 10, "max_ngram_size": 2}}
# The run's dtype -> the GGUF precision that matches it: (its name, llama_ftype).
FTYPES = {"float32": ("F32", 0), "fp32": ("F32", 0), "float16": ("F16", 1), "fp16": ("F16", 1),
          "bfloat16": ("BF16", 32), "bf16": ("BF16", 32)}
CTX_STEP = 256  # a context is sized in multiples of this
# One GGUF loaded and run in a child process, as a row would run it: some llama.cpp builds crash the
# whole process on some CPUs (on an AMX Xeon its AMX repack of Q4_1 weights segfaults, llama.cpp
# issue #20824, and llama-cpp-python cannot turn the repack off), and a crash must cost one row,
# not the run.
PROBE = """
import json, sys
from llama_cpp import Llama
llama = Llama(model_path=sys.argv[1], verbose=False, **json.loads(sys.argv[2]))
ids = [(7 + 37 * i) % llama.n_vocab() for i in range(min(llama.n_ctx() - 8, 300))]
llama.eval(ids)
llama.eval(ids[:1])
"""
PROBE_TIMEOUT_S = 300
# A GGUF whose conversion to the run's precision would be larger than this runs llama.cpp on the file
# alone: a 7B model's F32 copy is 27 GB, and specfree holds the file's own codes anyway.
MAX_CONVERTED_BYTES = 2 << 30


def import_llama_cpp():
    """The ``llama_cpp`` module; ImportError when llama-cpp-python is not installed (or did not build)."""
    return importlib.import_module("llama_cpp")


def installed() -> bool:
    try:
        import_llama_cpp()
    except ImportError:
        return False
    return True


def source_gguf(model: str) -> Path | None:
    """The GGUF file ``model`` is loaded from (the embedded name or a .gguf path), None for a
    transformers folder or hub id."""
    from specfree.loading import EMBEDDED, embedded_gguf

    if model in EMBEDDED:
        return embedded_gguf(model)
    if str(model).endswith(".gguf"):
        return Path(model).expanduser().resolve()
    return None


def select(baselines: Sequence[Any], model: str) -> tuple[list[Any], str | None]:
    """The llama.cpp entries of ``baselines`` (SystemSpecs) that can run, and the one line that says
    why none can. Where the user listed them in ``bench.baselines`` (not the default list), a missing
    llama-cpp-python is a ConfigError naming the install command, not a skipped row."""
    mine = [b for b in baselines if b.name in BASELINES]
    if not mine:
        return [], None
    for b in mine:
        check_knobs(b.name, b.knobs)
    explicit = [(b.name, b.knobs) for b in baselines] != [(name, {}) for name in DEFAULT_BASELINES]
    names = ", ".join(dict.fromkeys(b.name for b in mine))
    if source_gguf(model) is None:
        return [], (f"llama.cpp rows ({names}) skipped: {model} is not a GGUF file, so llama.cpp has no weights "
                    f"to run; give the model as one (model.path=FILE.gguf) to add them")
    if not installed():
        if explicit:
            raise ConfigError(f"bench.baselines asks for {names}, which need llama-cpp-python: {INSTALL} "
                              f"({BUILD_NOTE}), or leave them out of bench.baselines")
        return [], missing_line(names)
    return mine, None


def missing_line(names: str = ", ".join(BASELINES)) -> str:
    """The line a run prints where llama-cpp-python is missing and nobody asked for its rows by name."""
    return (f"llama.cpp rows ({names}) skipped: llama-cpp-python is not installed; "
            f"add them with {INSTALL} ({BUILD_NOTE})")


def gguf_precision(path: Path) -> str:
    """The GGUF's weight type as llama.cpp names it: F32, Q4_1..."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "unknown"
    name = gguf.LlamaFileType(int(field.contents())).name
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def converted_bytes(source: Path, dtype: str) -> int:
    """The size of ``source`` with every tensor at the run's precision (4 or 2 bytes a weight)."""
    import gguf

    width = 4 if FTYPES[dtype][0] == "F32" else 2
    return sum(int(t.n_elements) * width for t in gguf.GGUFReader(str(source)).tensors)


def file_line(path: Path, precision: str) -> str:
    """``name.gguf (Q4_K_M, 717 MB)``: a llama.cpp row's file, its type and size."""
    return f"{path.name} ({precision}, {path.stat().st_size / 1e6:.0f} MB)"


def converted_gguf(source: Path, dtype: str, cache_dir: Path) -> Path:
    """``source`` with every tensor in the run's precision (llama.cpp's quantize with
    allow_requantize), made once into ``cache_dir/llama_cpp`` and written atomically."""
    llama_cpp = import_llama_cpp()
    name, ftype = FTYPES[dtype]
    memo = cache_dir / "llama_cpp" / "digests"
    digest = file_digest(source, memo)  # by content: each virtual environment has its own copy of a wheel's file
    target = cache_dir / "llama_cpp" / f"{source.stem}-{fingerprint(digest, name)}.{name}.gguf"
    if target.is_file():
        remember_digest(source, memo, digest)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger("llama-cpp-python")  # where llama-cpp-python sends llama.cpp's log
    level = log.level
    log.setLevel(logging.ERROR)  # not a line per tensor
    try:
        with atomic_path(target) as tmp:  # a half-written file never looks complete
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.allow_requantize = True
            params.nthread = 0  # every core: it runs once
            if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
                raise ConfigError(f"llama.cpp could not convert {source} to {name}: set bench.baselines without "
                                  f"the llama_cpp rows, or give a GGUF llama.cpp reads")
    finally:
        log.setLevel(level)
    remember_digest(source, memo, digest)
    return target


@dataclass
class LlamaCppSystem:
    """One llama.cpp decoding loop over one GGUF, timed like every other system."""

    strategy: str
    llama: Any  # a llama_cpp.Llama that records its evals (see _recording)
    precision: str
    eos_ids: list[int]
    knobs: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)  # the GGUF, threads, context
    kind: str = "llama.cpp"
    path: str = "llama.cpp"  # its own loop, compared with no specfree path

    @property
    def label(self) -> str:
        return label(self.strategy, self.knobs, self.precision)

    @property
    def params(self) -> dict[str, Any]:
        return {**KNOBS[self.strategy], **self.knobs, "precision": self.precision, **self.details}

    def run(self, ids: list[int], max_new_tokens: int) -> Turn:
        llama = self.llama
        budget = min(max_new_tokens, llama.n_ctx() - len(ids))
        if budget <= 0:
            raise ConfigError(f"the prompt has {len(ids)} tokens but llama.cpp's context holds {llama.n_ctx()}")
        tokens: list[int] = []
        emitted: list[int] = []
        stop = None
        start = time.perf_counter()
        # As specfree's prefill: every prompt token but the last, which the first decode step runs.
        llama.reset()
        if len(ids) > 1:
            llama.eval(ids[:-1])
        prefill = time.perf_counter() - start
        llama.rows.clear()
        # generate() keeps the evaluated prefix and starts from the last prompt token.
        for token in llama.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            steps = len(llama.rows)
            emitted += [0] * (steps - len(emitted))
            emitted[-1] += 1
            tokens.append(int(token))
            if token in self.eos_ids:
                stop = "eos"
            elif len(tokens) >= budget:
                stop = "max_new_tokens" if budget == max_new_tokens else "context_length"
            if stop:
                break
        wall = time.perf_counter() - start
        rows = sum(llama.rows)
        return Turn(tokens=tokens, wall_s=wall, prompt_tokens=len(ids), stop_reason=stop, prefill_s=prefill,
                    steps=len(llama.rows), emitted=emitted, rows=rows, offered=rows)


def _recording(llama_cpp):
    """``llama_cpp.Llama`` that records the rows of every eval: the decode loop's steps."""

    class RecordingLlama(llama_cpp.Llama):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rows: list[int] = []

        def eval(self, tokens):
            super().eval(tokens)
            self.rows.append(len(tokens))

    return RecordingLlama


def describe_rows(systems: Sequence[Any], skipped: Sequence[str] = ()) -> str:
    """One line for the report: what ran the llama.cpp rows (and which were left out, and why) and
    what their identity column means."""
    llama_cpp = import_llama_cpp()
    mine = [s for s in systems if isinstance(s, LlamaCppSystem)]
    if not mine:
        return "; ".join(skipped)
    files = dict.fromkeys(file_line(Path(s.details["gguf"]), s.precision) for s in mine)
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    isa = [part.split("=")[0].split()[-1] for part in info.split("|") if part.strip().endswith("= 1")]
    return (f"llama.cpp rows: llama-cpp-python {llama_cpp.__version__}, CPU features {' '.join(isa) or 'none'}, "
            f"{mine[0].details['n_threads']} threads, on {', '.join(files)}; greedy, fed specfree's token ids; "
            f"'identical' counts the prompts where its output agrees with specfree's (other kernels: not lossless)"
            + "".join(f"; {line}" for line in skipped))


def context_size(needed: int, max_length: int) -> int:
    """KV slots for ``needed`` tokens in steps of CTX_STEP, at most the model's context."""
    return min(max_length, -(-max(needed, 1) // CTX_STEP) * CTX_STEP)


def llama_params(n_ctx: int, threads: int) -> dict[str, int]:
    """The context and threads of every llama.cpp row, and of its check in a child process (``crash``)."""
    return {"n_ctx": n_ctx, "n_batch": n_ctx, "n_ubatch": min(n_ctx, 512), "n_threads": threads,
            "n_threads_batch": threads}


def crash(path: Path, params: dict[str, int], probe: str = PROBE) -> str | None:
    """How llama.cpp dies running ``path`` with ``params`` (``llama_params``; ``probe``: a prefill and
    a decode step, in a child process), None if it does not."""
    try:
        done = subprocess.run([sys.executable, "-c", probe, str(path), json.dumps(params)],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"did not finish a {min(params['n_ctx'] - 8, 300)}-token prefill in {PROBE_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        try:
            return f"crashed ({signal.Signals(-done.returncode).name})"
        except ValueError:
            return f"was killed by signal {-done.returncode}"
    lines = done.stderr.strip().splitlines()
    return f"failed ({lines[-1] if lines else f'exit status {done.returncode}'})"


def build(specs: Sequence[Any], source: Path, dtype: str, cache_dir: Path, threads: int, n_ctx: int,
          eos_ids: Sequence[int]) -> tuple[list[LlamaCppSystem], list[str]]:
    """Every llama.cpp row asked for, on its conversion to the run's precision and on ``source``,
    and one line for each GGUF whose rows are left out because llama.cpp cannot run it here."""
    llama_cpp = import_llama_cpp()
    if dtype not in FTYPES:
        raise ConfigError(f"the llama.cpp rows need dtype float32, bfloat16 or float16, got {dtype!r}")
    rows = [(spec.name, check_knobs(spec.name, spec.knobs)) for spec in specs]
    check_listed_once([label(name, knobs, "") for name, knobs in rows])
    run_precision = FTYPES[dtype][0]
    files: dict[str, Path | None] = {run_precision: None, gguf_precision(source): source}
    skipped = []
    if files[run_precision] is None:  # the model's GGUF is not already at the run's precision
        size = converted_bytes(source, dtype)
        if size <= MAX_CONVERTED_BYTES:
            files[run_precision] = converted_gguf(source, dtype, cache_dir)
        else:
            del files[run_precision]
            skipped.append(f"llama.cpp rows at {run_precision} skipped: {source.name} at {run_precision} would be "
                           f"{size / 1e9:.1f} GB; they run on the file itself")
    params = llama_params(n_ctx, threads)
    for precision, path in list(files.items()):
        failure = crash(path, params)
        if failure:
            del files[precision]
            names = ", ".join(label(name, knobs, precision) for name, knobs in rows)
            skipped.append(f"{names} skipped: llama.cpp {failure} running {path.name} on this machine "
                           f"(checked in a child process); the other rows run")
    cls = _recording(llama_cpp)
    systems = []
    for name, knobs in rows:
        for precision, path in files.items():
            draft = None
            if name == "llama_cpp_lookup":
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                draft = LlamaPromptLookupDecoding(**{**KNOBS[name], **knobs})
            # logits_all: the draft model's rows are verified from their logits (llama-cpp-python needs it)
            llama = cls(model_path=str(path), **params, draft_model=draft, logits_all=draft is not None,
                        verbose=False)
            details = {"gguf": str(path), "n_threads": threads, "n_ctx": n_ctx}
            systems.append(LlamaCppSystem(name, llama, precision, sorted(eos_ids), knobs, details))
    return systems, skipped


def check_knobs(name: str, knobs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(knobs) - set(KNOBS[name]))
    if unknown:
        raise ConfigError(f"{name} takes no {', '.join(unknown)}; its knobs: {', '.join(KNOBS[name]) or 'none'}")
    return {k: check_int(f"{name}.{k}", v, low=1) for k, v in knobs.items()}


def label(name: str, knobs: dict[str, Any], precision: str) -> str:
    """``llama_cpp_lookup(num_pred_tokens=4)[F32]``: the knobs that differ from the defaults, the weights."""
    shown = {k: v for k, v in knobs.items() if KNOBS[name].get(k) != v}
    return f"{describe(name, shown)}[{precision}]"

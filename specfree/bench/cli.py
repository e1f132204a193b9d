"""``specfree bench``: read the config, load the model once, run, and report.

    python -m specfree bench bench=spec_bench bench.prompts=question.jsonl strategy=prompt_lookup

Outputs in ``bench.out`` (default: the Hydra run folder): ``bench.json`` (every record, rewritten
atomically after each one), ``report.md`` and PNG plots. Ctrl-C keeps what finished, prints the
partial table and exits with 130; ``bench.resume=true`` continues the run.
"""

from __future__ import annotations

import contextlib
import platform
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specfree.bench import store as store_mod
from specfree.bench.metrics import BASELINE, summarize
from specfree.bench.plots import cost_curve_plot, write_plots
from specfree.bench.prompts import load_prompts
from specfree.bench.report import markdown, rich_table, wide_console
from specfree.bench.runner import COMPILED, Conversation, SystemSpec, build_systems, run_records, system_meta, warm_up
from specfree.adapters.compiled import check_compile, make_adapter
from specfree.errors import ConfigError, check_int
from specfree.runinfo import cpu_name, versions

INTERRUPTED = 130


@dataclass
class BenchSettings:
    """Everything ``bench`` reads from the config, validated, as plain values."""

    prompts: Path
    out: Path
    model: str
    strategies: list[SystemSpec]
    baselines: list[SystemSpec]
    format: str = "spec_bench"
    fields: dict[str, str] = field(default_factory=dict)
    limit: int | None = None
    per_category: int | None = None
    max_new_tokens: int = 128
    repeats: int = 1
    warmup: int = 1
    resume: bool = False
    chat: bool = True
    markdown: bool = False
    cost_curves: bool = True  # the linear layers' and the forward's cost curves, measured before the runs
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    seed: int | None = None
    cache_dir: str | None = None
    model_options: dict[str, Any] = field(default_factory=dict)  # attn_implementation, revision
    linear_kernel: str = "few_row"  # the engines' linear layers (model.linear_kernel: few_row or library)
    compile: str = "auto"  # auto/true: strategies on the compiled forward, beside the eager baseline

    @classmethod
    def from_config(cls, cfg: Any) -> BenchSettings:
        root = _plain(cfg)
        bench = root.get("bench")
        if not isinstance(bench, Mapping):
            raise ConfigError("the bench command needs a bench config: add bench=spec_bench (or bench=custom)")
        if not bench.get("prompts"):
            raise ConfigError("bench.prompts is not set: point it at a prompt file, e.g. "
                              "bench.prompts=/data/spec_bench/question.jsonl")
        main = _spec(root.get("strategy") or BASELINE, "strategy")
        if root.get("pool"):  # the pool group feeds the main strategy
            main.knobs["pool"] = root["pool"]
        _check_greedy(root.get("verifier"))
        strategies = [main]
        strategies += [_spec(s, "bench.strategies") for s in bench.get("strategies") or []]
        baselines = [_spec(b, "bench.baselines") for b in bench.get("baselines") or []]
        out = bench.get("out") or _hydra_output_dir()
        if out is None:
            raise ConfigError("bench.out is not set and no Hydra run folder exists: set bench.out=DIR")
        return cls(
            prompts=_absolute(bench["prompts"]), out=_absolute(out), model=_model_name(root.get("model")),
            model_options=_model_options(root.get("model")),
            linear_kernel=_linear_kernel_option(root.get("model")),
            strategies=strategies, baselines=baselines, format=bench.get("format") or "spec_bench",
            fields=dict(bench.get("fields") or {}), limit=bench.get("limit"), per_category=bench.get("per_category"),
            max_new_tokens=check_int("bench.max_new_tokens", bench.get("max_new_tokens", 128), low=1),
            repeats=check_int("bench.repeats", bench.get("repeats", 1), low=1),
            warmup=check_int("bench.warmup", bench.get("warmup", 1), low=0),
            resume=bool(bench.get("resume", False)), chat=bool(bench.get("chat", True)),
            markdown=bool(bench.get("markdown", False)), cost_curves=bool(bench.get("cost_curves", True)),
            device=str(root.get("device") or "cpu"),
            dtype=str(root.get("dtype") or "float32"), threads=root.get("threads"), seed=root.get("seed"),
            cache_dir=root.get("cache_dir"), compile=check_compile("auto" if root.get("compile") is None else root.get("compile")))

    def meta(self) -> dict[str, Any]:
        return {"model": self.model, "prompts": str(self.prompts), "format": self.format, "fields": self.fields,
                "limit": self.limit, "per_category": self.per_category, "max_new_tokens": self.max_new_tokens,
                "repeats": self.repeats, "warmup": self.warmup, "chat": self.chat, "device": self.device,
                "dtype": self.dtype, "threads": self.threads, "seed": self.seed, "baseline": BASELINE,
                "linear_kernel": self.linear_kernel, "compile": self.compile,
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpu": cpu_name(),
                "versions": versions()}


def cost_curves(model, eager, compiled) -> dict[str, Any]:
    """ms per pass over the model's linear layers alone (torch's kernels against specfree's), and
    per forward at 256 tokens of context: eager with torch's linear layers, eager with the kernel,
    compiled. What decides how large a draft can pay on this machine."""
    from specfree.cost import CostModel
    from specfree.kernels import linear_path, stock_linears
    from specfree.kernels.measure import linear_curves

    def forward(adapter) -> dict[int, float]:
        curve = CostModel.measure(adapter, context=256)
        return {int(r): round(1e3 * s, 2) for r, s in zip(curve.rows, curve.seconds)}

    forwards = {}
    with stock_linears(model):
        forwards["eager, library linears"] = forward(eager)
    if linear_path(model) != "library":
        forwards[f"eager, {linear_path(model)}"] = forward(eager)
    if compiled is not None:
        forwards[f"compiled, {compiled.linears}"] = forward(compiled)
    return {"linear_curves_ms": linear_curves(model), "forward_curves_ms": forwards}


def compiled_adapter(model, settings: BenchSettings, slots: int):
    """The compiled adapter the strategies share (compile=auto or true), its graphs compiled up
    front for ``slots`` KV slots, so decode times hold no compile; None for compile=false, or
    where compiling cannot or did not work (it warned)."""
    if settings.compile == "false":
        return None
    adapter = make_adapter(model, "true", cache_dir=settings.cache_dir, slots=slots)
    return adapter if adapter.runner is not None else None


def kv_slots_needed(tokenizer, items, settings: BenchSettings) -> int:
    """KV slots for the longest prompt (all its turns) and its answers: static caches sized so no
    graph is compiled during the timed runs."""
    longest = max(len(tokenizer(" ".join(item.turns)).input_ids) + len(item.turns) * settings.max_new_tokens
                  for item in items)
    return longest + 64  # the chat template's own tokens, the last step's rows


def run(cfg: Any, console: Console | None = None) -> int:
    """Run the benchmark described by ``cfg``; return the exit code (0, or 130 when interrupted)."""
    console = console or wide_console()
    settings = BenchSettings.from_config(cfg)
    items = load_prompts(settings.prompts, settings.format, settings.fields, settings.limit, settings.per_category)
    store = store_mod.RecordStore(settings.out, settings.meta(), resume=settings.resume)

    import torch

    from specfree.adapters.loading import load_model

    if settings.threads:
        torch.set_num_threads(check_int("threads", settings.threads, low=1))
    model, tokenizer = load_model(settings.model, device=settings.device, dtype=settings.dtype,
                                  cache_dir=settings.cache_dir, **settings.model_options)
    if settings.chat and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{settings.model}'s tokenizer has no chat template: set bench.chat=false")
    slots = kv_slots_needed(tokenizer, items, settings)
    compiled = compiled_adapter(model, settings, slots)
    systems = build_systems(model, tokenizer, settings.strategies, settings.baselines, settings.seed,
                            settings.linear_kernel, compiled)
    for system in systems:
        if system.strategy == "hf_static_compiled":
            system.static_slots = slots
    store.set_systems([system_meta(s) for s in systems])
    if compiled is not None:
        store.meta["compile_s"] = compiled.compile_s
        store.meta["compiled_by"] = compiled.describe()
    if settings.cost_curves and not settings.resume:
        with Console(stderr=True).status("measuring the cost curves of the linear layers and the forward"):
            store.meta.update(cost_curves(model, systems[0].engine.adapter, compiled))
    engine = systems[0].engine
    describe = getattr(engine.adapter, "describe_verification", None)  # trees, or chains and why
    store.meta["verification"] = describe() if describe is not None else None
    conversation = Conversation(engine.encode, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                settings.chat)

    status = Console(stderr=True)
    try:
        with signals_interrupt():
            _execute(items, systems, conversation, store, settings, status)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
        status.print(f"[yellow]interrupted: {len(store.records)} finished records kept in {store.path}; "
                     f"rerun with bench.resume=true to continue[/yellow]")
    report(settings.out, console, settings.markdown)
    return INTERRUPTED if interrupted else 0


def _execute(items, systems, conversation, store, settings: BenchSettings, status: Console) -> None:
    """Warm up, then run with a progress bar (a terminal) or one line per record (a log file)."""
    total = len(items) * settings.repeats * len(systems)
    with status.status("warming up"):
        warm_up(systems, conversation, settings.max_new_tokens, settings.warmup)
    if not status.is_terminal:
        count = 0

        def log(item, system, record):
            nonlocal count
            count += 1
            if record is not None:
                status.print(f"[{count}/{total}] {progress_line(record)}", highlight=False)

        run_records(items, systems, conversation, store, settings.max_new_tokens, settings.repeats, log)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=status) as progress:
        task = progress.add_task("bench", total=total)

        def advance(item, system, record):
            progress.update(task, advance=1, description=f"{item.category} {item.id} {system.label}")

        run_records(items, systems, conversation, store, settings.max_new_tokens, settings.repeats, advance)


@contextlib.contextmanager
def signals_interrupt():
    """While running, SIGTERM (a scheduler, ``kill``) and SIGINT stop the run like Ctrl-C does,
    even where the shell started us with SIGINT ignored (``cmd &``). Handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    saved = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def progress_line(record: dict) -> str:
    if record["error"]:
        return f"{record['category']} {record['prompt_id']} {record['system']}: failed: {record['error']}"
    tokens = sum(len(t["tokens"]) for t in record["turns"])
    wall = sum(t["wall_s"] for t in record["turns"])
    same = {True: "identical", False: "DIFFERENT", None: "compared once the baseline has run"}[
        record["identical"]]
    return (f"{record['category']} {record['prompt_id']} {record['system']}: {tokens} tokens in {wall:.1f} s "
            f"({tokens / wall if wall else 0:.1f} tok/s), {same}")


def report(folder: str | Path, console: Console | None = None, as_markdown: bool = False) -> int:
    """Summarize a records folder: print the table, write ``report.md`` and the plots beside it."""
    console = console or wide_console()
    folder = Path(folder)
    doc = store_mod.read(folder)
    order = [s["label"] for s in doc.get("systems", [])]
    rows = summarize(doc["records"], doc["meta"].get("baseline", BASELINE), order)
    meta = doc["meta"]
    title = f"{meta.get('model')} · {meta.get('device')}/{meta.get('dtype')} · {meta.get('max_new_tokens')} new tokens"
    failures: dict[tuple[str, str], list[str]] = {}
    for r in doc["records"]:
        if r.get("error"):
            failures.setdefault((str(r["prompt_id"]), r["error"]), []).append(r["system"])
    notes = [(f"prompts: {meta.get('prompts')} (format {meta.get('format')}, chat={meta.get('chat')}, "
              f"limit={meta.get('limit')}, per_category={meta.get('per_category')}); repeats: {meta.get('repeats')}, "
              f"warm-up: {meta.get('warmup')}, threads: {meta.get('threads')}"),
             ("speedup: tokens/s over the autoregressive baseline's tokens/s on the same prompts, interleaved "
              "in the same run; ranges are min–max over repeats"),
             f"versions: {meta.get('versions')}; started {meta.get('started')} on {meta.get('host')}, "
             f"CPU: {meta.get('cpu')}",
             *([f"compiled forward (strategies and '{BASELINE}{COMPILED}'): {meta.get('compiled_by')}, ready in "
                f"{meta['compile_s']:.1f} s, not counted in any decode time"]
               if meta.get("compile_s") is not None else []),
             *(f"linear layers alone, ms per pass ({', '.join(map(str, curve))} rows): {name} "
               f"{' / '.join(f'{v:.1f}' for v in curve.values())}"
               for name, curve in (meta.get("linear_curves_ms") or {}).items()),
             *(f"forward at 256 tokens of context, ms ({', '.join(map(str, curve))} rows): {name} "
               f"{' / '.join(f'{v:.1f}' for v in curve.values())}"
               for name, curve in (meta.get("forward_curves_ms") or {}).items()),
             *([f"drafts verified: {meta['verification']}"] if meta.get("verification") else []),
             *([f"hf_static_compiled: its compile happens in the warm-up, outside the timed runs"]
               if any(s.get("strategy") == "hf_static_compiled" for s in doc.get("systems", [])) else []),
             *(f"failed: prompt {pid} on {', '.join(dict.fromkeys(names))}: {error}"
               for (pid, error), names in list(failures.items())[:20])]
    text = markdown(rows, title, notes)
    (folder / "report.md").write_text(text, encoding="utf-8")
    write_plots(rows, doc.get("systems", []), folder, doc["meta"].get("baseline", BASELINE))
    cost_curve_plot(meta, folder / "cost_curves.png")
    if as_markdown:
        console.print(text, markup=False, highlight=False)
    else:
        console.print(rich_table(rows, title))
        console.print(f"records: {folder / store_mod.FILENAME}   report: {folder / 'report.md'}")
    return 0


def _plain(cfg: Any) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"bench config must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


def _spec(value: Any, where: str) -> SystemSpec:
    """A strategy/baseline given as a name or as {name: ..., knob: value, ...}."""
    if isinstance(value, str):
        return SystemSpec(value, {})
    if isinstance(value, Mapping) and value.get("name"):
        knobs = {k: v for k, v in value.items() if k != "name" and not str(k).startswith("_")}
        return SystemSpec(str(value["name"]), knobs)
    raise ConfigError(f"{where}: each entry must be a name or a mapping with 'name' and knobs, got {value!r}")


def _model_name(model: Any) -> str:
    if isinstance(model, str) and model:
        return model
    if isinstance(model, Mapping):
        for key in ("path", "name"):
            if model.get(key):
                return str(model[key])
    raise ConfigError("no model given: set model=smollm2, or model.path=FOLDER_OR_GGUF")


def _model_options(model: Any) -> dict[str, Any]:
    if not isinstance(model, Mapping):
        return {}
    return {k: model[k] for k in ("attn_implementation", "revision") if model.get(k) is not None}


def _linear_kernel_option(model: Any) -> str:
    return model.get("linear_kernel", "few_row") if isinstance(model, Mapping) else "few_row"


def _check_greedy(verifier: Any) -> None:
    """Token identity against transformers' greedy generate() only means something for greedy decoding."""
    if verifier is None:
        return
    name = verifier if isinstance(verifier, str) else verifier.get("name")
    penalty = verifier.get("repetition_penalty", 1.0) if isinstance(verifier, Mapping) else 1.0
    if name != "greedy" or penalty not in (None, 1, 1.0):
        raise ConfigError("bench measures greedy decoding (it checks outputs token for token against "
                          "transformers' greedy generate): use verifier=greedy without repetition_penalty")


def _hydra_output_dir() -> str | None:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None


def _absolute(path: str | Path) -> Path:
    """Relative paths are relative to where the user started the command (Hydra may chdir)."""
    from hydra.core.hydra_config import HydraConfig

    path = Path(str(path)).expanduser()
    if not path.is_absolute() and HydraConfig.initialized():
        from hydra.utils import get_original_cwd

        path = Path(get_original_cwd()) / path
    return path.resolve()

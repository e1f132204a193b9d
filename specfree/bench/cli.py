"""``specfree bench``: read the config, load the model once, run, and report.

    python -m specfree bench bench=spec_bench bench.prompts=question.jsonl strategy=prompt_lookup

Outputs in ``bench.out`` (default: the Hydra run folder): ``bench.json`` (every record, rewritten
atomically after each one), ``report.md`` and PNG plots. Ctrl-C keeps what finished, prints the
partial table and exits with 130; ``bench.resume=true`` continues the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from specfree.bench import concurrent
from specfree.bench import llama_cpp as llama_rows
from specfree.bench import llama_server as server_rows
from specfree.bench import store as store_mod
from specfree.bench.metrics import BASELINE, summarize
from specfree.bench.methods import method_rows
from specfree.bench.plots import cost_curve_plot, paper_vs_measured, roofline_plot, write_plots
from specfree.bench.prompts import load_prompts, shipped_prompts
from specfree.bench.roofline import rich_table as roofline_table
from specfree.bench.roofline import section as roofline_section
from specfree.bench.report import (markdown, members_section, method_section, pricing_section, rich_method_table,
                                   rich_table, wide_console)
from specfree.bench.systems import LLAMA_CPP_BASELINES, LLAMA_SERVER_BASELINES, SpecfreeSystem
from specfree.bench.runner import COMPILED, Conversation, SystemSpec, build_systems, run_records, system_meta, warm_up
from specfree.conf.schema import STEP_KNOBS, BenchConfig, SpecfreeConfig
from specfree.errors import ConfigError, check_int
from specfree.files import cache_folder, user_path
from specfree.generation import VERIFIER_KNOBS
from specfree.parts import build_adapter
from specfree.progress import progress_bar
from specfree.runinfo import cpu_name, versions
from specfree.settings import EngineSettings, use_threads

INTERRUPTED = 130

OUTSIDE_LLAMA = (*LLAMA_CPP_BASELINES, *LLAMA_SERVER_BASELINES)  # built apart from build_systems


@dataclass
class BenchSettings:
    """What ``bench`` runs: the config as the schema's dataclasses (typed and checked by OmegaConf),
    and what follows from it."""

    config: SpecfreeConfig
    prompts: Path  # absolute: a relative path is relative to where the command started
    out: Path
    strategies: list[SystemSpec]  # the main strategy first
    baselines: list[SystemSpec]
    engine: EngineSettings  # compile (auto/true: strategies on the compiled forward, beside the eager
    # baseline), precision, linear kernel, cache folder
    decoding: dict[str, Any]  # every specfree system's verifier knobs ({}: plain greedy; ``decoding_knobs``)

    @property
    def bench(self) -> BenchConfig:
        return self.config.bench

    @property
    def model(self) -> str:
        return self.config.model.path or self.config.model.name

    @property
    def model_options(self) -> dict[str, Any]:  # attn_implementation, revision
        model = self.config.model
        options = {"attn_implementation": model.attn_implementation, "revision": model.revision}
        return {k: v for k, v in options.items() if v is not None}

    @classmethod
    def from_config(cls, cfg: Any) -> BenchSettings:
        from omegaconf import OmegaConf

        from specfree.conf.messages import config_error

        try:
            plain = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)  # untyped: Any stays plain
            if isinstance(plain.get("model"), str):  # a bare name or path, as the library API takes it
                plain["model"] = {"name": plain["model"], "path": None}
            if not isinstance(plain.get("bench"), Mapping):
                raise ConfigError("the bench command needs a bench config: add bench=spec_bench (or bench=custom)")
            if not plain["bench"].get("prompts"):
                raise ConfigError("bench.prompts is not set: point it at a prompt file, e.g. "
                                  "bench.prompts=/data/spec_bench/question.jsonl")
            config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SpecfreeConfig), plain))
        except Exception as exc:
            raise config_error(exc) from None
        # What the schema's types cannot say.
        bench = config.bench
        check_int("bench.max_new_tokens", bench.max_new_tokens, low=1)
        check_int("bench.repeats", bench.repeats, low=1)
        check_int("bench.warmup", bench.warmup, low=0)
        check_int("bench.concurrency", bench.concurrency, low=1, high=64)
        baselines = [_spec(b, "bench.baselines") for b in bench.baselines]
        decoding = decoding_knobs(config.verifier, baselines)
        main = _spec(config.strategy or BASELINE, "strategy")
        if config.pool:  # the pool group feeds the main strategy
            main.knobs["pool"] = config.pool
        out = bench.out or _hydra_output_dir()
        if out is None:
            raise ConfigError("bench.out is not set and no Hydra run folder exists: set bench.out=DIR")
        return cls(config, prompts=_prompts_path(bench.prompts), out=user_path(out).resolve(),
                   strategies=[main, *(_spec(s, "bench.strategies") for s in bench.strategies)],
                   baselines=baselines, decoding=decoding,
                   # the step knobs (priced...) are each system's own, not the run's
                   engine=EngineSettings.from_config(config, skip=tuple(STEP_KNOBS)))

    def meta(self) -> dict[str, Any]:
        bench, config = self.bench, self.config
        return {"model": self.model, "prompts": str(self.prompts), "format": bench.format, "fields": bench.fields,
                "limit": bench.limit, "per_category": bench.per_category, "max_new_tokens": bench.max_new_tokens,
                "repeats": bench.repeats, "warmup": bench.warmup, "chat": bench.chat, "device": config.device,
                "dtype": config.dtype, "threads": config.threads, "seed": config.seed, "baseline": BASELINE,
                "decoding": self.decoding or "greedy",
                "linear_kernel": self.engine.linear_kernel, "precision": self.engine.precision,
                "compile": self.engine.compile,
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpu": cpu_name(),
                "versions": versions()}


def curve_notes(meta: dict) -> list[str]:
    """One line per measured curve, each point also as a multiple of the run's read-pass floor."""
    floor = min((meta.get("linear_curves_ms") or {}).get("read_pass", {}).values(), default=None)
    lines = [f"read-pass floor (every weight read once, no arithmetic; same run): {floor:.1f} ms"] if floor else []
    for key, what in (("linear_curves_skipped", "linear layers alone: the dense variants (blas, oneDNN, panels, "
                                                "the read-pass floor) not measured, only the codes"),
                      ("library_forward_skipped", "forward with torch's linear layers not measured")):
        if meta.get(key):  # left out for want of memory
            lines.append(f"{what}: {meta[key]}")
    if meta.get("llama_batched_bench"):  # llama.cpp's own curve: the command it ran, or why none
        lines.append(f"llama.cpp's forward curve, {meta['llama_batched_bench']}")
    for key, what in (("linear_curves_ms", "linear layers alone, ms per pass"),
                      ("forward_curves_ms", "forward at 256 tokens of context, ms")):
        for name, curve in (meta.get(key) or {}).items():
            if name == "read_pass":
                continue
            ratios = f" = {' / '.join(f'{v / floor:.2f}' for v in curve.values())}x the floor" if floor else ""
            lines.append(f"{what} ({', '.join(map(str, curve))} rows): {name} "
                         f"{' / '.join(f'{v:.1f}' for v in curve.values())}{ratios}")
    # The curve the engines priced on, measured (or checked) when they were built: it can differ
    # from the forward curve above by the machine's noise between the two measurements.
    by_curve: dict[str, list[str]] = {}
    for label, curve in (meta.get("pricing_curves") or {}).items():
        points = dict(zip(curve["rows"], curve["seconds"]))
        shown = " / ".join(f"{1e3 * points[r]:.1f}" for r in curve["rows"])
        ratio = f"; t(8) = {points[8] / points[1]:.2f} t(1)" if 1 in points and 8 in points else ""
        by_curve.setdefault(f"({', '.join(map(str, curve['rows']))} rows, {curve.get('context', '?')} tokens of "
                            f"context): {shown}{ratio}", []).append(label)
    for text, labels in by_curve.items():
        lines.append(f"pricing curve of {', '.join(labels)}, ms {text}")
    return lines


def cost_curves(model, eager, compiled, gguf: Path | None, cache_dir: Path, threads: int) -> dict[str, Any]:
    """ms per pass over the model's linear layers alone (torch's kernels against specfree's), and
    per forward at 256 tokens of context: eager with torch's linear layers, eager with the kernel,
    compiled, and llama.cpp's own on the model's GGUF (``llama_batched``, where its tool is built).
    What decides how large a draft can pay on this machine. Then the roofline of the model's coded
    calls against this machine's read bandwidth and arithmetic peaks (``bench/roofline.py``), or why
    it has none."""
    from specfree.cost import CostModel
    from specfree.kernels import linear_path, stock_linears
    from specfree.bench import llama_batched
    from specfree.bench.linear_curves import linear_curves, no_room_for_copies
    from specfree.bench.roofline import roofline

    def forward(adapter) -> dict[int, float]:
        curve = CostModel.measure(adapter, context=256)
        return {int(r): round(1e3 * s, 2) for r, s in zip(curve.rows, curve.seconds)}

    forwards: dict[str, dict[int, float]] = {}
    meta: dict[str, Any] = {}
    meta["library_forward_skipped"] = no_room_for_copies(model, copies=1)  # torch's layers unpack every weight
    if meta["library_forward_skipped"] is None:
        with stock_linears(model):
            forwards["eager, library linears"] = forward(eager)
    if linear_path(model) != "library":
        forwards[f"eager, {linear_path(model)}"] = forward(eager)
    if compiled is not None:
        forwards[f"compiled, {compiled.linears}"] = forward(compiled)
    if gguf is not None:
        curve, meta["llama_batched_bench"] = llama_batched.forward_curve(gguf, cache_dir, threads)
        if curve is not None:
            forwards[f"llama.cpp {llama_rows.gguf_precision(gguf)}, {llama_batched.NAME}"] = curve
    # The linear curves time CPU kernels (specfree's and torch's) on CPU tensors: on a GPU, forwards only.
    on_cpu = next(model.parameters()).device.type == "cpu"
    linears = {}
    if on_cpu:
        meta["linear_curves_skipped"] = no_room_for_copies(model)
        linears = linear_curves(model, dense=meta["linear_curves_skipped"] is None)
    limits = roofline(model)  # the codes the engine's model holds, as its forward calls them
    meta["roofline_skipped" if "skipped" in limits else "roofline"] = limits.get("skipped", limits)
    return {**meta, "linear_curves_ms": linears, "forward_curves_ms": forwards}


def compiled_adapter(model, settings: BenchSettings, slots: int):
    """The compiled adapter the strategies share (compile=auto or true), its graphs compiled up
    front for ``slots`` KV slots, so decode times hold no compile; None for compile=false, or
    where compiling cannot or did not work (it warned)."""
    if settings.engine.compile == "false":
        return None
    adapter = build_adapter(model, None, dataclasses.replace(settings.engine, compile="true"), slots=slots)
    return adapter if adapter.compiled else None


def kv_slots_needed(tokenizer, items, settings: BenchSettings) -> int:
    """KV slots for the longest prompt (all its turns) and its answers: static caches sized so no
    graph is compiled during the timed runs."""
    longest = max(len(tokenizer(" ".join(item.turns)).input_ids) + len(item.turns) * settings.bench.max_new_tokens
                  for item in items)
    return longest + 64  # the chat template's own tokens, the last step's rows


def run(cfg: Any, console: Console | None = None) -> int:
    """Run the benchmark described by ``cfg``; return the exit code (0, or 130 when interrupted)."""
    console = console or wide_console()
    settings = BenchSettings.from_config(cfg)
    bench = settings.bench
    llama, llama_line = llama_rows.select(settings.baselines, settings.model)  # before the slow model load
    source = llama_rows.source_gguf(settings.model)
    servers = server_rows.select(settings.baselines, source, cache_folder(settings.engine.cache_dir))
    items = load_prompts(settings.prompts, bench.format, bench.fields, bench.limit, bench.per_category)
    store = store_mod.RecordStore(settings.out, settings.meta(), resume=settings.bench.resume)

    import torch

    from specfree.loading import load_model

    use_threads(settings.config.threads)
    model, tokenizer = load_model(settings.model, device=settings.config.device, dtype=settings.config.dtype,
                                  cache_dir=settings.config.cache_dir, **settings.model_options)
    if settings.bench.chat and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{settings.model}'s tokenizer has no chat template: set bench.chat=false")
    slots = kv_slots_needed(tokenizer, items, settings)
    compiled = compiled_adapter(model, settings, slots)
    systems = build_systems(model, tokenizer, settings.strategies,
                            [b for b in settings.baselines if b.name not in OUTSIDE_LLAMA],
                            settings.config.seed, settings.engine, compiled, settings.decoding)
    # llama.cpp's rows: the run's threads, a context that holds what the compiled slots hold, the same EOS
    outside = (cache_folder(settings.engine.cache_dir), torch.get_num_threads(),
               llama_rows.context_size(slots, systems[0].engine.adapter.max_length), systems[0].engine.eos_ids)
    if llama:
        built, skipped = llama_rows.build(llama, source, settings.config.dtype, *outside)
        systems += built
        llama_line = llama_rows.describe_rows(systems, skipped)
    if servers:
        systems += server_rows.build(servers, source, llama_rows.gguf_precision(source), *outside)
        llama_line = "; ".join(filter(None, [llama_line, server_rows.describe_rows(systems)]))
    if llama_line:
        Console(stderr=True).print(llama_line, highlight=False, markup=False, soft_wrap=True)
        store.meta["llama_cpp"] = llama_line
    for system in systems:
        if system.strategy == "hf_static_compiled":
            system.static_slots = slots
    store.set_systems([system_meta(s) for s in systems])
    # The curve each priced engine prices its steps on (measured once per setup, then cached): what
    # `specfree replay` prices the same steps on.
    store.meta["pricing_curves"] = {s.label: s.engine.costs.as_dict() for s in systems
                                    if getattr(getattr(s, "engine", None), "costs", None) is not None}
    if compiled is not None:
        store.meta["compile_s"] = compiled.compile_s
        store.meta["compiled_by"] = compiled.describe()
    if settings.bench.cost_curves and not settings.bench.resume:
        with Console(stderr=True).status("measuring the cost curves of the linear layers and the forward"):
            store.meta.update(cost_curves(model, systems[0].engine.adapter, compiled, source, *outside[:2]))
    engine = systems[0].engine
    store.meta["verification"] = engine.adapter.capabilities.describe()  # trees, or chains and why
    ran = engine.adapter.path()  # precision=auto's choice for this CPU, and why (kernels/precision.py)
    store.meta["precision_ran"], store.meta["precision_because"] = ran["precision"], ran["precision_because"]
    conversation = Conversation(engine.encode, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                settings.bench.chat)

    status = Console(stderr=True)
    try:
        with signals_interrupt():
            _execute(items, systems, conversation, store, settings, status)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
        status.print(f"[yellow]interrupted: {len(store.records)} finished records kept in {store.path}; "
                     f"rerun with bench.resume=true to continue[/yellow]")
    if bench.concurrency > 1 and not interrupted:
        _concurrency(items, systems, conversation, store, settings, model, tokenizer, status)
    report(settings.out, console, settings.bench.markdown)
    return INTERRUPTED if interrupted else 0


def _concurrency(items, systems, conversation, store, settings: BenchSettings, model, tokenizer,
                 status: Console) -> None:
    """Each specfree system's prompts ``bench.concurrency`` at a time against one after another
    (``bench/concurrent.py``), eager and compiled; each row is stored as it is measured."""
    bench = settings.bench
    prompts = [conversation.first_ids(item.turns[0]) for item in items]
    rows = store.meta.setdefault("concurrency", [])
    for system in systems:
        if not isinstance(system, SpecfreeSystem):
            continue
        def fresh(system=system):
            return SpecfreeSystem.build(model, tokenizer, system.strategy, system.knobs, settings.config.seed,
                                        settings=settings.engine, adapter=system.engine.adapter,
                                        costs=system.engine.costs, decoding=settings.decoding).engine
        with status.status(f"{system.label}: {len(prompts)} requests one after another, then "
                           f"{bench.concurrency} at a time"):
            rows.append(concurrent.measure(fresh, system.label, prompts, bench.max_new_tokens, bench.concurrency))
        store.save()


def _execute(items, systems, conversation, store, settings: BenchSettings, status: Console) -> None:
    """Warm up, then run with a progress bar (a terminal) or one line per record (a log file)."""
    total = len(items) * settings.bench.repeats * len(systems)
    with status.status("warming up"):
        warm_up(systems, conversation, settings.bench.max_new_tokens, settings.bench.warmup)
    if not status.is_terminal:
        count = 0

        def log(item, system, record):
            nonlocal count
            count += 1
            if record is not None:
                status.print(f"[{count}/{total}] {progress_line(record)}", highlight=False)

        run_records(items, systems, conversation, store, settings.bench.max_new_tokens, settings.bench.repeats, log)
        return
    with progress_bar(status, remaining=True) as progress:
        task = progress.add_task("bench", total=total)

        def advance(item, system, record):
            progress.update(task, advance=1, description=f"{item.category} {item.id} {system.label}")

        run_records(items, systems, conversation, store, settings.bench.max_new_tokens, settings.bench.repeats, advance)


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


def decoding_title(meta: dict) -> str:
    """`` · sampling (temperature=0.7), seed 0`` for a run that did not decode plain greedy; ''."""
    decoding = meta.get("decoding")
    if not isinstance(decoding, Mapping):  # "greedy", or a run from before this was recorded
        return ""
    knobs = ", ".join(f"{k}={v}" for k, v in decoding.items() if k not in ("do_sample", "seed"))
    line = f" · {'sampling' if decoding.get('do_sample') else 'greedy'}" + (f" ({knobs})" if knobs else "")
    if decoding.get("do_sample"):  # the run's seed wins over the verifier's (SpecfreeSystem.run)
        line += f", seed {meta['seed'] if meta.get('seed') is not None else decoding.get('seed', 0)}"
    return line


def report(folder: str | Path, console: Console | None = None, as_markdown: bool = False) -> int:
    """Summarize a records folder: print the table, write ``report.md`` and the plots beside it."""
    console = console or wide_console()
    folder = Path(folder)
    doc = store_mod.read(folder)
    order = [s["label"] for s in doc.get("systems", [])]
    rows = summarize(doc["records"], doc["meta"].get("baseline", BASELINE), order)
    meta = doc["meta"]
    title = f"{meta.get('model')} · {meta.get('device')}/{meta.get('dtype')} · {meta.get('max_new_tokens')} new tokens"
    title += decoding_title(meta)
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
             *curve_notes(meta),
             *([f"drafts verified: {meta['verification']}"] if meta.get("verification") else []),
             *([meta["llama_cpp"]] if meta.get("llama_cpp") else []),
             *(["hf_static_compiled: its compile happens in the warm-up, outside the timed runs"]
               if any(s.get("strategy") == "hf_static_compiled" for s in doc.get("systems", [])) else []),
             *(f"failed: prompt {pid} on {', '.join(dict.fromkeys(names))}: {error}"
               for (pid, error), names in list(failures.items())[:20])]
    per_method = method_rows(doc["records"], doc.get("systems", []))
    text = markdown(rows, title, notes, sections=[method_section(per_method), members_section(rows),
                                                  pricing_section(rows), concurrent.section(meta.get("concurrency", [])),
                                                  roofline_section(meta)])
    (folder / "report.md").write_text(text, encoding="utf-8")
    write_plots(rows, doc.get("systems", []), folder, doc["meta"].get("baseline", BASELINE))
    paper_vs_measured(per_method, folder / "paper_vs_measured.png")
    cost_curve_plot(meta, folder / "cost_curves.png")
    roofline_plot(meta, folder / "roofline.png")
    if as_markdown:
        console.print(text, markup=False, highlight=False)
    else:
        console.print(rich_table(rows, title))
        if per_method:
            console.print(rich_method_table(per_method))
        if meta.get("roofline"):
            console.print(roofline_table(meta["roofline"]))
        console.print(f"records: {folder / store_mod.FILENAME}   report: {folder / 'report.md'}")
    return 0


def _spec(value: Any, where: str) -> SystemSpec:
    """A strategy/baseline given as a name or as {name: ..., knob: value, ...}."""
    if isinstance(value, str):
        return SystemSpec(value, {})
    if isinstance(value, Mapping) and value.get("name"):
        knobs = {k: v for k, v in value.items() if k != "name" and not str(k).startswith("_")}
        return SystemSpec(str(value["name"]), knobs)
    raise ConfigError(f"{where}: each entry must be a name or a mapping with 'name' and knobs, got {value!r}")


BENCH_VERIFIER_KNOBS = (*VERIFIER_KNOBS, "seed")  # what a bench run may set; logits processors are code


def decoding_knobs(verifier: Any, baselines: Sequence[SystemSpec]) -> dict[str, Any]:
    """The verifier knobs every specfree system decodes with: {} for plain greedy (the default),
    else ``do_sample`` and the verifier's knobs. Seeded sampling is compared token for token with
    specfree's own sampling loop, so it runs without outside baselines: transformers and llama.cpp
    draw their own random numbers (and their rows run plain greedy)."""
    if verifier is None:
        return {}
    name = verifier if isinstance(verifier, str) else verifier.get("name")
    given = {k: v for k, v in verifier.items() if k != "name" and v is not None} if isinstance(verifier, Mapping) else {}
    if name not in ("greedy", "sampling"):
        raise ConfigError(f"bench decodes with verifier=greedy or verifier=sampling, not {name!r}")
    unknown = sorted(set(given) - set(BENCH_VERIFIER_KNOBS))
    if unknown:
        raise ConfigError(f"bench: verifier.{unknown[0]} cannot be set in a bench run; it takes "
                          f"{', '.join(BENCH_VERIFIER_KNOBS)}")
    if name == "greedy" and given.get("repetition_penalty", 1.0) == 1.0:
        return {}
    if baselines:
        raise ConfigError(f"verifier={name} with {', '.join(k for k in given) or 'its defaults'}: set "
                          "'bench.baselines=[]'. Outside baselines decode plain greedy with their own code, "
                          "so they cannot be compared token for token with this run")
    return {"do_sample": name == "sampling", **given}


def _hydra_output_dir() -> str | None:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None


def _prompts_path(name: str | Path) -> Path:
    """A shipped prompt set's file (``code_edits``), else the path as the user meant it."""
    return shipped_prompts(name) or user_path(name).resolve()

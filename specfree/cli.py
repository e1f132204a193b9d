"""The command line: ``python -m specfree <command> [overrides]`` (also installed as ``specfree``).

``decode`` and ``bench`` run through ``hydra.main``, so multirun (``-m``), output folders and
launchers are Hydra's own. Every job's config is composed here first: a mistake in any of them
is reported as one line (exit code 2) before anything runs, instead of Hydra's multi-line report.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from specfree.errors import ConfigError, SpecfreeError
from specfree.files import user_path
from specfree.settings import use_threads
from specfree.startup import StartupSplit, phase_of
from specfree.sweeps import CoreShares, available_cpus

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from rich.console import Console

    from specfree.plugins import Registry

DIVERGED = 1  # verify_against_baseline found a token where plain decoding differs
USAGE_ERROR = 2
INTERRUPTED = 130
COMMANDS = {
    "decode": "generate from one prompt, streamed; tokens from accepted drafts are marked",
    "bench": "benchmark strategies over a prompt file (bench=spec_bench or bench=custom)",
    "compare": "one table over decode multirun folders and bench outputs: compare DIR...",
    "ceiling": "how fast a perfect copier could have been on a bench run's outputs: ceiling DIR",
    "roofline": "the model's coded calls against this machine's read bandwidth and arithmetic peaks: roofline [--out DIR] [key=value ...]",
    "replay": "strategies replayed on a bench run's outputs, priced on its curve: replay DIR [STRATEGY ...] [--flat F] [--curve OTHER]",
    "plugins": "list registered strategies, pools, verifiers, adapters and where each comes from",
    "datastore": "build a retrieval datastore from corpora or from the model's own answers",
    "serve": "an OpenAI-compatible server (/v1/chat/completions...) over one engine: serve serve.port=8000",
    "build-kernels": "build specfree's C++ kernels now, once (the set-up line runs it): build-kernels [cache_dir=PATH]",
    "warm-up": "build a model's compiled forward, cost curve and warm start now, once (the set-up line runs it "
               "for the embedded model): warm-up [threads=N] [model=...]",
}
EXAMPLES = """\
examples:
  python -m specfree decode prompt="Summarize: ..."    (strategy=hybrid, priced: the default)
  echo "Tell me a story" | python -m specfree decode chat=false max_new_tokens=64
  python -m specfree decode -m strategy=autoregressive,prompt_lookup strategy.priced=true,false prompt="..."
  python -m specfree compare multirun/2026-01-01/12-00-00
  python -m specfree bench bench.prompts=spec_bench_questions.jsonl bench.limit=10
  python -m specfree ceiling outputs/2026-01-01/12-00-00
  python -m specfree roofline threads=2 --out roofline
  python -m specfree replay outputs/2026-01-01/12-00-00 prompt_lookup hybrid --flat 1.15
  python -m specfree serve serve.port=8000 serve.api_key=KEY   (docs/serve.md)
  python -m specfree decode --help      (the full config, Hydra's flags)"""


def main(argv: Sequence[str] | None = None) -> int:
    split = StartupSplit()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(help_text())
            return 0 if argv else USAGE_ERROR
        command, args = argv[0], argv[1:]
        if command not in COMMANDS:
            raise ConfigError(f"unknown command {command!r}; commands: {', '.join(COMMANDS)} (see --help)")
        if command == "compare":
            return compare(args)
        if command == "plugins":
            return plugins(args)
        if command == "ceiling":
            return _delegate("specfree.bench.ceiling", "main", "ceiling")(args)
        if command == "roofline":
            return _delegate("specfree.bench.roofline", "main", "roofline")(args)
        if command == "replay":
            return _delegate("specfree.bench.replay", "main", "replay")(args)
        if command == "datastore":
            return _delegate("specfree.datastore", "main", "datastore")(args)
        if command == "build-kernels":
            return _delegate("specfree.kernels.build", "build_command", "build-kernels")(args)
        return hydra_command(command, args, split)
    except SpecfreeError as exc:
        print_error(exc)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return INTERRUPTED


def run() -> NoReturn:
    """The command line's entry point (``specfree``, ``python -m specfree``): ``main``, then out
    without the interpreter's teardown. Freeing a decode's objects one by one (torch's and
    transformers' modules, the model) takes most of a second in a process that ends anyway; the exit
    handlers still run, and the standard streams are flushed, first."""
    try:
        code = main()
    except SystemExit as exc:  # Hydra's task ends a failed job this way
        code = exc.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    if multiprocessing.active_children() or threading.active_count() > 1:
        # Worker pools (Hydra's joblib launcher) shut down from threading's exit hook, which runs
        # before the exit handlers only in the interpreter's own exit.
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe has nothing left to flush
            stream.flush()
    os._exit(code or 0)


def print_error(exc: BaseException) -> None:
    print(f"error: {exc}", file=sys.stderr, flush=True)


def help_text() -> str:
    from specfree.config import group_options

    lines = ["usage: python -m specfree <command> [group=option] [key=value ...] [-m]", "", "commands:"]
    lines += [f"  {name:<10} {about}" for name, about in COMMANDS.items()]
    lines += ["", "config groups (pick an option with group=option, set a field with group.field=value):"]
    lines += [f"  {group:<9} {', '.join(options) or '(none registered)'}" for group, options in group_options().items()]
    lines += ["", "top-level settings: prompt, prompt_file, chat, max_new_tokens, stop, ignore_eos, seed,",
              "  json_schema, json_object, regex, grammar (structured output: docs/structured-output.md),",
              "  generation, device, dtype, threads, cache_dir, output, verify_against_baseline, prompt_cache", "",
              EXAMPLES]
    return "\n".join(lines)


# ---- decode and bench: through Hydra ------------------------------------------------------
def hydra_command(command: str, args: list[str], split: StartupSplit | None = None) -> int:
    import hydra
    from hydra._internal.utils import (
        get_args_parser,  # Hydra's own flags: -m, --cfg, --help...
    )

    from specfree.config import CONFIG_MODULE, CONFIG_NAME, compose, compose_here, packaged_configs, register_config_nodes
    from specfree.plugins import build_plugin_manager, registry

    parser = get_args_parser()
    parser.prog = f"python -m specfree {command}"
    try:
        parsed = parser.parse_args(args)
    except SystemExit as usage:  # argparse has printed the usage and the problem
        return usage.code if isinstance(usage.code, int) else USAGE_ERROR
    if parsed.multirun and (parsed.cfg or parsed.info or parsed.shell_completion):
        raise ConfigError("--cfg and --info show one job's config: drop -m (and give one value per setting)")
    with phase_of(split, "plugins"):  # the built-in components' modules: torch and numpy come with them
        reg = registry(build_plugin_manager())
    overrides = [quote_free_text(o) for o in parsed.overrides]
    if command == "bench" and not any(o.lstrip("+").startswith("bench=") for o in overrides):
        overrides.insert(0, "bench=spec_bench")
    if command == "serve":
        if parsed.multirun:
            raise ConfigError("serve runs one server: drop -m")
        if not any(o.lstrip("+").startswith("serve=") for o in overrides):
            overrides.insert(0, "serve=default")
    if command == "warm-up" and not any(o.lstrip("+").startswith("compile=") for o in overrides):
        overrides.append("compile=true")  # what it is for: the compiled forward, built now
    runs = not (parsed.help or parsed.hydra_help or parsed.cfg or parsed.info or parsed.shell_completion)
    flags = [a for a in args if a not in parsed.overrides]
    if runs and not flags:  # one run, no Hydra flags: composed once, here, and run from that config
        register_config_nodes(reg)
        with packaged_configs(job_name=command):
            run = compose_here(overrides, reg, job=command)
            task = job_task(command, reg, [job_config(run)], CoreShares(1), split)
            return run_composed(task, run)
    # composing registers the config nodes Hydra's run below reads
    jobs = [compose(job, reg) for job in (sweep_jobs(overrides) if parsed.multirun else [overrides])]
    shares = CoreShares(len(jobs))  # jobs run at once by a local launcher (joblib) split the cores
    task = job_task(command, reg, jobs if runs else [], shares, split)
    app = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME, version_base="1.3")(task)
    # hydra.main reads its arguments from sys.argv; hand it this command's, then put them back.
    saved = sys.argv
    sys.argv = [f"specfree {command}", *flags, f"hydra.job.name={command}", *overrides]
    try:
        with shares:
            app()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else USAGE_ERROR
    finally:
        sys.argv = saved
    return 0


def job_task(command: str, reg, jobs: list, shares: CoreShares, split: StartupSplit | None) -> Callable[[Any], None]:
    """The function Hydra runs for each job of ``command``, once ``jobs`` (the composed configs that
    will run) are checked: a missing value, or no prompt at all, is reported before anything runs."""
    piped = None
    for cfg in jobs:
        _require_values(cfg)
        if command == "decode" and piped is None and cfg.prompt is None and cfg.prompt_file is None:
            piped = read_stdin()  # once: every job of a sweep decodes the same piped prompt
            read_prompt(cfg, piped)
    if command == "serve":
        serve = _delegate("specfree.serve.cli", "run", "serve")
        runner = lambda cfg: serve(cfg, reg)  # noqa: E731
    elif command == "warm-up":
        runner = lambda cfg: warm_up(cfg, reg)  # noqa: E731
    else:
        runner = ((lambda cfg: decode(cfg, reg, piped=piped, split=split if len(jobs) == 1 else None))
                  if command == "decode"
                  else _delegate("specfree.bench.cli", "run", "bench"))
    def task(cfg) -> None:
        try:
            with shares.claim(cfg):
                code = runner(cfg)
        except SpecfreeError as exc:
            print_error(exc)
            raise SystemExit(USAGE_ERROR) from None
        if code:
            raise SystemExit(code)  # also stops a sweep: the later jobs would fail the same way

    return task


def job_config(run):
    """A run's config as its job sees it: without Hydra's own node."""
    import copy

    from omegaconf import open_dict, read_write

    cfg = copy.deepcopy(run)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


def run_composed(task: Callable[[Any], None], run) -> int:
    """One job run as ``hydra.main`` runs it (output folder, saved configs, logging, callbacks), from
    ``run``, a config composed with its ``hydra`` node: ``hydra.main`` would compose it twice more."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext

    from specfree.config import CONFIG_NAME

    configure_log(run.hydra.hydra_logging, run.hydra.verbose)
    callbacks = Callbacks(run)
    callbacks.on_run_start(config=run, config_name=CONFIG_NAME)
    context = HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=callbacks)
    try:
        done = run_and_report(lambda: run_job(task_function=task, config=run, job_dir_key="hydra.run.dir",
                                              job_subdir_key=None, hydra_context=context))
        callbacks.on_run_end(config=run, config_name=CONFIG_NAME, job_return=done)
        run_and_report(lambda: done.return_value)  # a failed job's exception, reported as Hydra does
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else USAGE_ERROR
    return 0


FREE_TEXT = ("prompt", "json_schema", "regex", "grammar")  # settings whose value is any text (JSON, a regex...)


def quote_free_text(override: str) -> str:
    """``prompt=`` (and a schema, regex or grammar) takes any text: quote it for Hydra so commas,
    colons, braces or parentheses survive."""
    key, sep, value = override.partition("=")
    if key.lstrip("+") not in FREE_TEXT or not sep or not value or value[0] in "'\"":
        return override
    return f"{key}='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Every job of a ``-m`` sweep, as the overrides of one run (the cartesian product)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from specfree.config import config_error

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                   else [o.input_line] for o in parsed]
    except Exception as exc:
        raise config_error(exc) from None
    return [list(job) for job in itertools.product(*choices)]


def _require_values(cfg) -> None:
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        hint = " (model=local reads a folder or a .gguf file)" if missing[0] == "model.path" else ""
        raise ConfigError(f"{missing[0]} is required: add {missing[0]}=...{hint}")


def _delegate(module: str, function: str, command: str) -> Callable[..., int]:
    """A command another part of specfree provides; a clear message when it is not installed."""
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError):
        raise ConfigError(f"{command} is not available in this install ({module}.{function} is missing)") from None


# ---- warm-up ------------------------------------------------------------------------------
def warm_up(cfg: DictConfig, reg: Registry) -> int:
    """Build what a later ``decode`` or ``serve`` of this config reads from the cache: the model's
    config, codes and compiled forward (each build shown with its progress), the cost curve, and the
    warm start that lets them skip building the model (``adapters/warm.py``)."""
    from transformers.utils import logging as hf_logging

    from specfree.config import engine_parts
    from specfree.engine import Engine

    start = time.perf_counter()
    use_threads(cfg.threads)
    hf_logging.disable_progress_bar()
    engine = Engine(**engine_parts(cfg, reg, warm=True))
    kept = "kept for the next start" if engine.adapter.compiled else "eager: no warm start (compile=true builds one)"
    print(f"warmed up in {time.perf_counter() - start:.1f} s: {engine.adapter.path()['forward']} ({kept})",
          file=sys.stderr)
    return 0


# ---- decode -------------------------------------------------------------------------------
def decode(cfg: DictConfig, reg: Registry, out: Console | None = None, err: Console | None = None,
           piped: str | None = None, split: StartupSplit | None = None) -> int:
    """Stream one completion; drafted tokens in green on a terminal; a summary line on stderr.

    ``piped`` is the text already read from stdin (else stdin is read when there is no prompt).
    ``split``: the start-up split since the command's ``main`` (one job; else one from here),
    written to result.json up to the first token.
    """
    split = split or StartupSplit()
    split.unclaimed("config")  # Hydra: parsing, composing, its run folder
    with split.phase("imports"):  # transformers, mostly
        from rich.console import Console
        from rich.text import Text
        from transformers.utils import logging as hf_logging

        from specfree.config import engine_parts, knobs
        from specfree.detokenize import Detokenizer
        from specfree.engine import Engine

    out = out or Console(highlight=False, soft_wrap=True)
    err = err or Console(stderr=True, highlight=False, soft_wrap=True)
    prompt = read_prompt(cfg, piped)
    use_threads(cfg.threads)
    hf_logging.disable_progress_bar()  # a weight-loading bar would land between prompt and answer
    parts = engine_parts(cfg, reg, split, warm=True)
    with split.phase("engine"):  # the cost curve, read from its cache and checked
        engine = Engine(**parts)
    settings = engine.model_settings.line()  # what the model's generation_config changed, said once
    if settings:
        err.print(Text(settings, style="yellow"))
    verification = engine.adapter.capabilities.describe()
    if engine.adapter.capabilities.chain_only:  # trees are the rule; say so when not
        err.print(Text(verification, style="yellow"))
    chat = bool(cfg.chat and getattr(engine.tokenizer, "chat_template", None))
    ids = engine.encode(prompt, chat=chat)
    run_kwargs = {"max_new_tokens": cfg.max_new_tokens, "stop": list(cfg.stop), "seed": cfg.seed,
                  "ignore_eos": cfg.ignore_eos, **constraint_options(cfg)}
    stream = engine.stream(ids, **run_kwargs)
    detok = Detokenizer(engine.tokenizer)
    tokens: list[int] = []
    drafted: list[bool] = []
    steps, generation, start, startup = 0, None, time.perf_counter(), None
    try:
        while True:
            chunk = next(stream)
            if startup is None:  # the prompt's prefill and the first step, then the split is complete
                split.ended("first_step", since=start)
                startup = split.as_dict()
            for token, from_draft in zip(chunk.tokens, chunk.from_draft):
                # Per token, so a step's accepted drafts and the model's own token differ in colour.
                out.print(Text(detok.push(token), style="green" if from_draft else ""), end="")
            tokens += chunk.tokens
            drafted += chunk.from_draft
            steps += 1
    except StopIteration as done:
        generation = done.value
    except KeyboardInterrupt:
        pass  # keep what was generated: print it, its summary and its result file
    out.print(detok.flush())
    wall = time.perf_counter() - start
    partial = {"tokens": tokens, "drafted": drafted, "steps": steps, "wall": wall}
    result = _result(cfg, prompt, ids, generation, partial, knobs(cfg.strategy), engine.tokenizer)
    result["verification"] = verification
    result["startup"] = startup or split.as_dict()
    result.update(run_record(engine, cfg))
    line = Text(summary_line(result))
    line.highlight_regex(r"\d+ drafted", "green")  # the legend for the coloured tokens above
    err.print(line)
    if generation is not None and getattr(engine.strategy, "labels", None):  # a hybrid: who drafted what
        err.print(drafted_by_line(generation.accepted_by, engine.strategy.labels))
    if generation is None:
        _write_result(cfg, result)
        return INTERRUPTED
    check = baseline_check(cfg, engine, generation, ids, run_kwargs)
    if check is not None:
        err.print(Text(check.describe(engine.tokenizer), style="green" if check.identical else "red"))
        result["baseline_check"] = {key: getattr(check, key) for key in BASELINE_CHECK_FIELDS}
    _write_result(cfg, result)
    return DIVERGED if check is not None and not check.identical else 0


def constraint_options(cfg) -> dict:
    """``json_schema=FILE_OR_JSON``, ``regex=...``, ``grammar=FILE_OR_TEXT``, ``json_object=true`` as
    ``Engine.generate``'s keywords (a value naming a file is read)."""
    from specfree.constraints import read_option

    options = {name: read_option(name, cfg[name]) if name != "regex" else cfg[name]
               for name in ("json_schema", "regex", "grammar") if cfg[name] is not None}
    return {**options, "json_object": True} if cfg.json_object else options


BASELINE_CHECK_FIELDS = ("identical", "first_divergence", "speculative_token", "baseline_token")


def baseline_check(cfg, engine, generation, ids: list[int], run_kwargs: dict):
    """With ``verify_against_baseline=true``: plain decoding of the same prompt and settings,
    compared token by token (in bf16/fp16 batched rows may flip a near-tie); else None."""
    if not cfg.verify_against_baseline:
        return None
    from specfree.check import check_against_baseline

    return check_against_baseline(engine, generation, ids, **run_kwargs)


def read_prompt(cfg, piped: str | None = None) -> str:
    """``prompt``, else ``prompt_file``, else the text piped on stdin (``piped`` if already read)."""
    if cfg.prompt is not None and cfg.prompt_file is not None:
        raise ConfigError("give prompt=... or prompt_file=..., not both")
    # An empty prompt is a mistake (a chat template would otherwise wrap nothing and answer it).
    if cfg.prompt is not None:
        if not str(cfg.prompt).strip():
            raise ConfigError('the prompt is empty: give prompt="..." with some text')
        return str(cfg.prompt)
    if cfg.prompt_file is not None:
        return read_prompt_file(user_path(cfg.prompt_file))
    text = read_stdin() if piped is None else piped
    if not text.strip():
        raise ConfigError('no prompt: give prompt="...", prompt_file=PATH, or pipe text on stdin')
    return text


def read_prompt_file(path: Path) -> str:
    if path.is_dir():
        raise ConfigError(f"prompt_file {path} is a folder: give a text file")
    if not path.is_file():
        raise ConfigError(f"prompt_file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"prompt_file {path} is not UTF-8 text (undecodable byte at offset {exc.start}); "
                          "give a text file") from None
    except OSError as exc:
        raise ConfigError(f"prompt_file {path} cannot be read: {exc.strerror}") from None
    if not text.strip():
        raise ConfigError(f"prompt_file {path} is empty: put the prompt's text in it")
    return text


def read_stdin() -> str:
    """Piped input, or "" when stdin is a terminal (nobody is typing a prompt into a pipe)."""
    if sys.stdin is None or sys.stdin.isatty():
        return ""
    not_text = ConfigError("the input piped on stdin is not UTF-8 text: pipe a text file")
    try:
        text = sys.stdin.read()
        text.encode("utf-8")  # under a C locale, undecodable bytes arrive as lone surrogates
    except UnicodeError:
        raise not_text from None
    return text


def summary_line(result: dict) -> str:
    """``8 tokens · 16.2 tok/s · 5 forwards · 1.60 tokens/step · 4 drafted · 12 of 40 rows kept · hybrid``:
    the rows the strategy offered and those pricing kept (all of them with ``strategy.priced=false``)."""
    s = result["summary"]
    drafted = sum(result["drafted_mask"])
    rows = f" · {s['rows_kept']} of {s['rows_offered']} rows kept" if "rows_offered" in s else ""
    unpriced = " (unpriced)" if result["strategy"].get("priced") is False else ""
    return (f"{s['new_tokens']} tokens · {s['tokens_per_s']:.1f} tok/s · {s['forwards']} forwards · "
            f"{s['mean_accepted']:.2f} tokens/step · {drafted} drafted{rows} · {result['strategy']['name']}{unpriced}"
            + (" · interrupted" if result["interrupted"] else ""))


def drafted_by_line(accepted_by: dict[str, int], members: list[str]) -> str:
    """``accepted drafts by member: prompt_lookup 31 · trie 12 · lookahead 0``."""
    return "accepted drafts by member: " + " · ".join(f"{m} {accepted_by.get(m, 0)}" for m in members)


def _result(cfg, prompt, ids, generation, partial, strategy, tokenizer) -> dict:
    import torch
    from omegaconf import OmegaConf

    if generation is not None:
        summary, steps, text = generation.summary(), [asdict(s) for s in generation.steps], generation.text
        tokens, drafted = generation.tokens, generation.drafted_mask
    else:  # interrupted: the engine's records went with its generator; count what was printed
        tokens, drafted, wall, n = partial["tokens"], partial["drafted"], partial["wall"], partial["steps"]
        summary = {"new_tokens": len(tokens), "prompt_tokens": len(ids), "forwards": n,
                   "mean_accepted": len(tokens) / max(1, n), "tokens_per_s": len(tokens) / wall if wall > 0 else 0.0,
                   "wall_s": wall, "stop_reason": "interrupted"}
        steps, text = [], tokenizer.decode(tokens, skip_special_tokens=True)
    return {"kind": "decode", "config": OmegaConf.to_container(cfg, resolve=True), "overrides": _task_overrides(),
            "model": cfg.model.path or cfg.model.name, "strategy": {"name": cfg.strategy.name, **strategy},
            "prompt": prompt, "prompt_tokens": len(ids), "tokens": tokens, "text": text, "drafted_mask": drafted,
            "summary": summary, "steps": steps, "interrupted": generation is None,
            "threads": torch.get_num_threads(), "cpus": available_cpus()}


def run_record(engine, cfg) -> dict:
    """What ran: the model's generation settings followed, the forward path, the CPU and versions."""
    from specfree.runinfo import cpu_info, forward_path, versions

    return {"generation": {"mode": cfg.generation, **asdict(engine.model_settings)},
            "path": forward_path(engine), "cpu": cpu_info(), "versions": versions()}


def _task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _write_result(cfg, result: dict) -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    if cfg.output is not None:
        path = user_path(cfg.output)
    elif HydraConfig.initialized():
        path = Path(HydraConfig.get().runtime.output_dir) / "result.json"
    else:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the result to {path}: {exc.strerror} (set output=FILE.json)") from None
    return path


# ---- compare ------------------------------------------------------------------------------
def compare(args: list[str], console: Console | None = None) -> int:
    """One table over decode results (each job's ``result.json``) and one over bench outputs."""
    if not args or any(a.startswith("-") for a in args):
        raise ConfigError("usage: python -m specfree compare DIR_OR_FILE... (multirun or bench output folders)")
    return _delegate("specfree.bench.compare", "compare", "compare")(args, console=console)


# ---- plugins ------------------------------------------------------------------------------
def plugins(args: list[str], console: Console | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from specfree.config import COMPONENT_GROUPS
    from specfree.plugins import KINDS, build_plugin_manager, registry

    if args:
        raise ConfigError("usage: python -m specfree plugins")
    reg = registry(build_plugin_manager())
    from specfree.conf.schema import STEP_KNOBS

    step = ", ".join(f"{k}={default}" for k, (_, default) in STEP_KNOBS.items())
    table = Table("kind", "name", "from", "hybrid member", "knobs (config defaults)", title="registered components",
                  caption="adapters choose per model, when they wrap it, how drafts are verified: draft trees, or "
                          "one chain a step where its forward cannot take a tree mask (decode and bench say which); "
                          f"every strategy also takes the step knobs {step} (strategy.priced=false: at its knobs)")
    for kind in KINDS:
        for name in reg.names(kind):
            component = reg.get(kind, name)
            member = ("yes" if component.hybrid_member else "no (holds members)") if kind == "strategy" else ""
            table.add_row(kind, name, component.source, member,
                          _knob_defaults(component) if kind in COMPONENT_GROUPS else "")
    (console or Console(highlight=False)).print(table)
    return 0


def _knob_defaults(component) -> str:
    from omegaconf import MISSING

    from specfree.config import knob_fields

    try:
        fields = knob_fields(component)
    except SpecfreeError as exc:
        return f"(broken: {exc})"
    show = lambda v: "(required)" if v == MISSING else repr(v) if isinstance(v, str) else str(v)  # noqa: E731
    return ", ".join(f"{knob}={show(default)}" for knob, (_, default) in fields.items())

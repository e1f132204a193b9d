"""A code-editing workload made offline from the Python standard library's own source.

Each prompt shows one stdlib function (``inspect.getsource``) and asks for an edit whose answer
repeats most of the code: add type hints, rename a variable, add a docstring, add comments, use
pathlib instead of ``os.path``, use f-strings. The multi-turn set chains two or three edits, each
turn editing the model's previous answer, so one request's output feeds the next.

    python -m specfree.bench.code_edits --out specfree/bench/data --seed 0

writes ``code_edits.jsonl`` (``--count`` prompts, an equal share per edit kind) and
``code_edits_multi_turn.jsonl`` (``--chains`` prompts per chain of edits). Rows are the
``jsonl`` prompt format: ``{"id", "category", "turns", "source", "python"}`` where ``category``
is the edit kind (or the chain, ``type_hints+docstring``) and ``source`` names the function.
The choice is deterministic for one seed and one Python minor version (the stdlib's source is
what is sampled, so another Python may pick other functions); the shipped files were made with
the Python named in each row.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import platform
import random
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType

# Pure-Python modules present from 3.10 to 3.13, none deprecated: their functions are plain code.
# (Not `warnings`: test runners swap its functions, so the set would depend on who runs it.)
MODULES = ("argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "copy", "csv", "difflib",
           "dis", "email.utils", "filecmp", "fnmatch", "fractions", "ftplib", "functools", "genericpath", "getopt",
           "gettext", "glob", "gzip", "heapq", "html", "http.cookies", "inspect", "ipaddress", "json.decoder",
           "json.encoder", "linecache", "locale", "mailbox", "mimetypes", "netrc", "ntpath", "os", "pkgutil",
           "platform", "plistlib", "posixpath", "pprint", "py_compile", "pydoc", "quopri", "random", "shlex",
           "shutil", "statistics", "string", "sysconfig", "tabnanny", "tarfile", "tempfile", "textwrap",
           "tokenize", "trace", "traceback", "urllib.parse", "urllib.request", "uuid", "webbrowser",
           "zipfile")
MIN_LINES, MAX_LINES = 6, 30
# About 250 SmolLM2 tokens at most: the prompt fits its 8k context with room for the edited copy
# (128-256 new tokens) in every turn of a three-turn conversation.
MAX_CHARS = 900
REPLY = "Reply with the complete updated function in one Python code block."
FOLLOW_UP = "Now take the function from your last answer"
NEW_NAMES = ("value", "item", "entry", "chunk", "piece", "current", "element", "record", "part", "token")
CHAINS = (("rename_variable", "type_hints", "docstring"), ("type_hints", "docstring"),
          ("comments", "rename_variable"), ("f_strings", "type_hints"))
_FORMATTING = re.compile(r"""['"][^'"\n]*%[-#0 +]*\d*(\.\d+)?[sdrifx][^'"\n]*['"]\s*%|\.format\(""")


@dataclass(frozen=True)
class Function:
    module: str
    name: str
    source: str
    node: ast.FunctionDef

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class EditKind:
    """An edit: when it applies to a function, and its instruction (``first`` turn or a follow-up)."""

    name: str
    applies: Callable[[Function], bool]
    instruction: Callable[[Function, random.Random], str]


def _local_names(fn: Function) -> list[str]:
    """Names the function assigns or takes (parameters first), three letters or longer."""
    args = fn.node.args
    params = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg not in ("self", "cls")]
    stored = [n.id for n in ast.walk(fn.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return [n for n in dict.fromkeys([*params, *stored]) if len(n) >= 3 and not n.startswith("_")]


def _identifiers(fn: Function) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", fn.source))


def _rename(fn: Function, rng: random.Random) -> str:
    old = rng.choice(_local_names(fn))
    taken = _identifiers(fn)
    new = rng.choice([n for n in NEW_NAMES if n not in taken and n != old])
    return f"rename the variable `{old}` to `{new}` everywhere in it, changing nothing else"


def _has_params(fn: Function) -> bool:
    args = fn.node.args
    return any(a.arg not in ("self", "cls") for a in [*args.posonlyargs, *args.args, *args.kwonlyargs])


def _unannotated(fn: Function) -> bool:
    args = fn.node.args
    return fn.node.returns is None and not any(a.annotation for a in [*args.posonlyargs, *args.args,
                                                                       *args.kwonlyargs])


KINDS: dict[str, EditKind] = {kind.name: kind for kind in (
    EditKind("type_hints", lambda f: _has_params(f) and _unannotated(f),
             lambda f, rng: "add type hints to every parameter and to the return value"),
    EditKind("rename_variable", lambda f: bool(_local_names(f) and [n for n in NEW_NAMES if n not in _identifiers(f)]),
             _rename),
    EditKind("docstring", lambda f: ast.get_docstring(f.node) is None,
             lambda f, rng: "add a docstring that says what it does, its arguments and what it returns"),
    EditKind("comments", lambda f: True,
             lambda f, rng: "add a short comment above each step that is not obvious"),
    EditKind("pathlib", lambda f: "os.path." in f.source,
             lambda f, rng: "replace os.path with pathlib.Path, keeping its behaviour"),
    EditKind("f_strings", lambda f: bool(_FORMATTING.search(f.source)),
             lambda f, rng: "turn its % and str.format string formatting into f-strings"),
)}


def stdlib_functions(modules: Sequence[str] = MODULES) -> list[Function]:
    """Module-level functions of ``modules`` whose source is between MIN_LINES and MAX_LINES
    lines and at most MAX_CHARS characters, undecorated, sorted by module and name."""
    found = []
    for module_name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except ImportError:  # a module this Python lacks: the others still make a set
            continue
        for name, obj in sorted(vars(module).items()):
            if not isinstance(obj, FunctionType) or obj.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            lines = source.rstrip("\n").count("\n") + 1
            if not source.startswith("def ") or not MIN_LINES <= lines <= MAX_LINES or len(source) > MAX_CHARS:
                continue
            node = ast.parse(source).body[0]
            if isinstance(node, ast.FunctionDef):
                found.append(Function(module_name, name, source.rstrip("\n"), node))
    return found


def first_turn(fn: Function, instruction: str) -> str:
    return (f"Here is the function `{fn.name}` from Python's `{fn.module}` module:\n\n```python\n{fn.source}\n```\n\n"
            f"In this function, {instruction}. {REPLY}")


def follow_up(instruction: str) -> str:
    return f"{FOLLOW_UP} and {instruction}. {REPLY}"


def make_single(functions: Sequence[Function], count: int, seed: int,
                kinds: Sequence[str] = tuple(KINDS)) -> list[dict]:
    """``count`` prompts, an equal share per edit kind (kinds in order), no function used twice."""
    if count < len(kinds) or count % len(kinds):
        raise ValueError(f"count must be a multiple of the {len(kinds)} edit kinds, got {count}")
    rng = random.Random(seed)
    used: set[str] = set()
    rows = []
    for kind_name in kinds:
        kind = KINDS[kind_name]
        pool = [f for f in functions if f.qualname not in used and kind.applies(f)]
        if len(pool) < count // len(kinds):
            raise ValueError(f"only {len(pool)} stdlib functions fit the edit {kind_name!r}")
        for fn in rng.sample(pool, count // len(kinds)):
            used.add(fn.qualname)
            rows.append(_row(f"{kind_name}-{fn.qualname}", kind_name, [first_turn(fn, kind.instruction(fn, rng))], fn))
    return rows


def make_multi_turn(functions: Sequence[Function], per_chain: int, seed: int,
                    chains: Sequence[Sequence[str]] = CHAINS, exclude: set[str] = frozenset()) -> list[dict]:
    """``per_chain`` conversations per chain of edits: turn 1 shows the code and asks for the first
    edit, each later turn asks for the next edit of the previous answer."""
    rng = random.Random(seed + 1)
    used = set(exclude)
    rows = []
    for chain in chains:
        pool = [f for f in functions if f.qualname not in used and all(KINDS[k].applies(f) for k in chain)]
        if len(pool) < per_chain:
            raise ValueError(f"only {len(pool)} stdlib functions fit the chain {'+'.join(chain)!r}")
        for fn in rng.sample(pool, per_chain):
            used.add(fn.qualname)
            instructions = [KINDS[k].instruction(fn, rng) for k in chain]
            turns = [first_turn(fn, instructions[0]), *(follow_up(i) for i in instructions[1:])]
            category = "+".join(chain)
            rows.append(_row(f"{category}-{fn.qualname}", category, turns, fn))
    return rows


def _row(id: str, category: str, turns: list[str], fn: Function) -> dict:
    return {"id": id, "category": category, "turns": turns, "source": fn.qualname,
            "python": platform.python_version()}


def make_sets(count: int = 48, per_chain: int = 3, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """The single-edit set and the multi-turn set, sharing no function."""
    functions = stdlib_functions()
    single = make_single(functions, count, seed)
    multi = make_multi_turn(functions, per_chain, seed, exclude={row["source"] for row in single})
    return single, multi


def write_jsonl(rows: Sequence[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specfree.bench.code_edits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data", help="folder for the two files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=48, help=f"single-edit prompts (a multiple of {len(KINDS)})")
    parser.add_argument("--chains", type=int, default=3, help=f"multi-turn prompts per chain ({len(CHAINS)} chains)")
    args = parser.parse_args(argv)
    single, multi = make_sets(args.count, args.chains, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for rows, name in ((single, "code_edits.jsonl"), (multi, "code_edits_multi_turn.jsonl")):
        print(f"{write_jsonl(rows, args.out / name)}: {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

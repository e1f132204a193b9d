"""Try every family the installed transformers ships as a causal LM, on a tiny random model, and
write the verdicts into docs/families.md: identical to ``generate`` / refused (why) / not tested (why).

    python -m benchmarks.families_report            # all families, 2 worker processes, ~10-20 minutes
    python -m benchmarks.families_report llama mamba  # some families, printed only
    python -m benchmarks.families_report --update bloom mpt  # rerun some families, their rows rewritten in place

Not run by CI (slow). Each family runs in its own process with a time limit. A tiny config is made
by shrinking the family's default config (``tests/family_configs.py``); a family whose tiny model cannot
be built, or whose ``generate`` fails, is "not tested". "different" would be a lossless bug.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from datetime import date
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.family_configs import NOT_TESTED, causal_lm_class, tiny_config

STRATEGIES = {
    "prompt_lookup": dict(num_candidates=3, draft_len=6),  # sibling candidates: trees
    "lookahead": {},
    "trie": {},
    "recycling": {},
}
# Repetitive, so prompt lookup drafts several sibling candidates; 20 + 16 tokens outrun a 32-token window.
PROMPT = [5, 6, 7, 8, 9] * 3 + [10, 11, 5, 6, 7]
NEW_TOKENS = 16
TIME_LIMIT_S = 240
DOC = Path(__file__).resolve().parents[1] / "docs" / "families.md"
START, END = "<!-- families-report:start -->", "<!-- families-report:end -->"


def try_family(model_type: str) -> dict:
    """The verdict for one family (run in a child process)."""
    import torch
    import transformers

    from specfree import Engine, UnsupportedModelError
    from tests.tiny_models import Oracle, reference_greedy

    transformers.utils.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        config = tiny_config(model_type)
        # a sub-config (MusicGen's decoder) is not in the auto mapping: its causal LM class builds it
        build = transformers.AutoModelForCausalLM.from_config if type(config) is transformers.CONFIG_MAPPING[
            model_type] else causal_lm_class(model_type)._from_config
        try:
            model = build(config, attn_implementation="sdpa")
        except (ValueError, ImportError):  # no SDPA path in this family
            torch.manual_seed(0)
            model = build(tiny_config(model_type))  # a fresh config: the failed try set its attention
        model.eval()
        model.generation_config.pad_token_id = 0
        # generate would force EOS as the last token (encoder-decoder configs); specfree's Engine has no
        # such processor, and this report checks verification, not generation-config processors
        model.generation_config.forced_eos_token_id = None
    except Exception as exc:
        note = f" {NOT_TESTED[model_type]}" if model_type in NOT_TESTED else ""
        return dict(verdict="not tested", why=f"no tiny model: {type(exc).__name__}: {_short(exc)}{note}")
    try:
        reference = reference_greedy(model, PROMPT, NEW_TOKENS, ignore_eos=True)
        truth = PROMPT + reference_greedy(model, PROMPT, NEW_TOKENS + 8, ignore_eos=True)
    except Exception as exc:
        try:  # a model specfree refuses on its own grounds is refused, whatever its generate does
            Engine.from_model(model, None, "prompt_lookup")
        except UnsupportedModelError as refusal:
            if refusal.__cause__ is None:  # not a probe forward that failed: that is the model's own failure
                return dict(verdict="refused", why=_short(refusal, 400))
        except Exception:
            pass
        return dict(verdict="not tested", why=f"generate fails: {type(exc).__name__}: {_short(exc)}")
    strategies = dict(STRATEGIES, oracle=None)
    covered, mode = [], None
    for name, knobs in strategies.items():
        try:
            strategy = Oracle(truth, depth=4, wrong_at=2) if knobs is None else name
            # The oracle checks chains and rollbacks at its own depth: unpriced.
            engine = Engine.from_model(model, None, strategy, **(knobs if knobs is not None else {"priced": False}))
        except UnsupportedModelError as exc:
            return dict(verdict="refused", why=_short(exc, 400))
        except Exception as exc:
            return dict(verdict="error", why=f"wrapping: {type(exc).__name__}: {_short(exc)}")
        adapter = engine.adapter
        mode = "one row" if adapter.capabilities.max_chain == 0 else adapter.capabilities.verification
        mode += "" if adapter.capabilities.keeps_cache else ", no KV cache"
        try:
            result = engine.generate(PROMPT, NEW_TOKENS, ignore_eos=True)
        except Exception as exc:
            return dict(verdict="error", why=f"{name}: {type(exc).__name__}: {_short(exc)}", mode=mode)
        tokens = result.tokens
        if result.stop_reason == "context_length" and tokens == reference[: len(tokens)]:
            # windowed layers specfree cannot mask per kind: the context stops at the window
            mode += f" (context capped at {adapter.max_length})"
        elif tokens != reference:
            first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
            return dict(verdict="different", why=f"{name}: from new token {first}", mode=mode)
        covered.append(name)
    return dict(verdict="identical", mode=mode, strategies=covered)


def _short(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_one(model_type: str) -> dict:
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.families_report", "--one", model_type],
                              capture_output=True, text=True, timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired:
        return dict(verdict="not tested", why=f"over the {TIME_LIMIT_S} s limit")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return dict(verdict="error", why=f"the process died: {_short(done.stderr[-400:])}")
    return json.loads(lines[-1])


def how(r: dict) -> str:
    text = r.get("how") or (f"{r['mode']}: {', '.join(r['strategies'])}" if r["verdict"] == "identical" else r["why"])
    return text.replace("|", "/")


def table(results: dict[str, dict]) -> str:
    order = {"different": 0, "error": 1, "identical": 2, "refused": 3, "not tested": 4}
    counts = {v: sum(r["verdict"] == v for r in results.values()) for v in order}
    modes = [how(r).split(":")[0].split(" (")[0] for r in results.values() if r["verdict"] == "identical"]
    kinds = {kind: sum(m.startswith(kind) for m in modes) for kind in ("tree", "chain", "one row")}
    lines = [", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" (of {len(results)}). Identical: "
             + ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n) + " verified"
             + f" ({sum('custom mask' in m for m in modes)} of the chains under specfree's causal mask, "
             f"{sum('no KV cache' in m for m in modes)} without a KV cache).", "",
             "| family | verdict | how / why |", "|---|---|---|"]
    for family, r in sorted(results.items(), key=lambda kv: (order[kv[1]["verdict"]], kv[0])):
        lines.append(f"| `{family}` | {r['verdict']} | {how(r)} |")
    return "\n".join(lines)


def rows_in_doc() -> dict[str, dict]:
    """The table now in docs/families.md, as {family: {verdict, how}}."""
    body = DOC.read_text().split(START)[1].split(END)[0]
    return {family: dict(verdict=verdict, how=text) for family, verdict, text
            in re.findall(r"^\| `([^`]+)` \| ([a-z ]+) \| (.*) \|$", body, flags=re.M)}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        print(json.dumps(try_family(argv[1])))
        return
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    update = argv[:1] == ["--update"]
    argv = argv[1:] if update else argv
    families = argv or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(families, pool.map(run_one, families)))
    for family, r in results.items():
        print(family, r, flush=True)
    if argv and not update:
        return
    if update:
        results = {**rows_in_doc(), **results}
    body = (f"Generated by `python -m benchmarks.families_report` with transformers {__version__}: every model type "
            f"in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, one tiny random model each, prompt {len(PROMPT)} tokens + "
            f"{NEW_TOKENS} new, greedy, checked token for token against `generate(do_sample=False)`. "
            "Modes, as the wrap-time probes chose them: `tree` verifies draft trees; `chain, custom mask` "
            "one chain a step under specfree's causal 4D mask (the model takes a mask but not a tree); "
            "`chain, own mask` one chain a step under the model's own causal mask (recurrent layers, with "
            "rollback; chunked attention; a forward that rejects or ignores a custom mask); `no KV cache`: "
            "the whole sequence runs again each step; `one row` plain decoding (the model's forward cannot "
            "continue its recurrent state over several tokens). `oracle` drafts the true continuation with every "
            "other step's third token wrong, so whole and cut drafts are both verified."
            + (f" Some rows were rerun with `--update` after the last full run, the latest on {date.today()}."
               if update else "")
            + "\n\n" + table(results))
    text = DOC.read_text()
    text = re.sub(f"{re.escape(START)}.*{re.escape(END)}", lambda _: f"{START}\n{body}\n{END}", text, flags=re.S)
    DOC.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])

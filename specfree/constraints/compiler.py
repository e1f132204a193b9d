"""Constraints compiled with llguidance over one tokenizer (docs/structured-output.md says why
llguidance): the tokenizer's conversion is made once per engine, each grammar once per text."""

from __future__ import annotations

import functools
from collections.abc import Collection

from specfree.constraints.matcher import Matcher
from specfree.constraints.spec import Constraint
from specfree.errors import ConfigError

# The layout of JSON answers: one space after ':' and ',' (what models write, and Python's
# json.dumps), none elsewhere. A fixed layout lets the grammar force the separators' text, which
# the grammar drafter proposes for free; a schema's own "x-guidance" options override it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """Compiles ``Constraint``s into ``Matcher``s for one tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Collection[int]):
        if tokenizer is None:
            raise ConfigError("a constraint (json_schema, regex, grammar) needs the model's tokenizer; "
                              "build the engine with one")
        import llguidance.hf

        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                          eos_token=sorted(eos_ids) or None)
        except ValueError as exc:  # only fast (Rust) tokenizers convert
            raise ConfigError(f"constraints need a fast Hugging Face tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        self.compiled = functools.lru_cache(maxsize=64)(self._compile)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher at the start of the constrained answer."""
        import llguidance

        return Matcher(llguidance.LLMatcher(self.tokenizer, self.compiled(constraint), log_level=0),
                       self.vocab_size, constraint)

    def _compile(self, constraint: Constraint) -> str:
        import llguidance

        try:
            grammar = grammar_text(constraint)
        except ValueError as exc:
            raise ConfigError(f"{constraint.kind} does not compile: {exc}") from None
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if error or messages:  # a warning is a part llguidance would ignore: refuse it, never drop it silently
            what = "does not compile" if error else "has what would be ignored"
            raise ConfigError(f"{constraint.kind} {what}: {' '.join(' '.join(messages).split())}; "
                              "rewrite or remove that part")
        return grammar


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (ValueError: the text is not what its kind needs)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if constraint.kind in ("json_schema", "json_object"):
        return LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_LAYOUT)
    if constraint.kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.text)
    try:  # Lark as it is; llama.cpp's GBNF converted to Lark
        return LLMatcher.grammar_from_lark(any_to_lark(constraint.text))
    except Exception as exc:  # the converter raises its own error types on malformed GBNF
        raise ValueError(f"not a Lark or GBNF grammar ({exc})") from None

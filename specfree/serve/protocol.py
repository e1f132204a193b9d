"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, checked into one ``Ask``.

Every mistake is a 400 naming the field. Fields the server cannot honour (``n > 1``, ``tools``,
``echo``...) are refused by name when set to anything but their neutral value. llama-server's
common fields are taken at the top level (``n_predict``, ``cache_prompt``, ``top_k``, ``min_p``,
``repeat_penalty``...); any other top-level field is ignored and named (``Ask.unknown``: the
server logs it once and names it in the ``X-Specfree-Ignored-Fields`` header), as peers do.
specfree's own per-request knobs live under one extra field, ``specfree`` (``top_k``,
``repetition_penalty``, ``ignore_eos``). Structured output: OpenAI's ``response_format``
(``json_object``, ``json_schema``) and llama-server's ``json_schema`` and ``grammar`` (GBNF or Lark),
one of them a request (docs/structured-output.md). Tool calls (chat only): ``tools``, ``tool_choice``,
``parallel_tool_calls`` and the deprecated ``functions``/``function_call`` (``serve.tools``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from specfree.constraints import Constraint
from specfree.errors import ConfigError
from specfree.serve.errors import bad
from specfree.serve.tools import Tools, assistant_calls, check_results, parse_tools

MAX_STOPS = 16
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "function": "tool"}  # function: the deprecated role of a function's result
SPECFREE_KNOBS = ("top_k", "repetition_penalty", "ignore_eos")


def _off(value: Any) -> bool:
    return value in (None, False, 0, "", [], {})


# Fields accepted only at their neutral value: what the OpenAI API defines there and this server cannot do.
UNSUPPORTED = {
    "n": lambda v: v in (None, 1), "best_of": lambda v: v in (None, 1),
    "echo": _off, "suffix": _off, "tools": _off, "functions": _off,
    "tool_choice": lambda v: v in (None, "none"), "function_call": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: True, "audio": _off, "modalities": lambda v: v in (None, ["text"]),
    "prediction": _off, "web_search_options": _off, "reasoning_effort": _off,
}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}  # chat's own
IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "specfree",
          "n_predict", "cache_prompt", "top_k", "min_p", "repeat_penalty", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "logit_bias", "logprobs", "response_format", "json_schema", "grammar"}
FIELDS = {"chat": COMMON | TOOL_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"},
          "completion": COMMON | {"prompt"}}
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # OpenAI's bounds


@dataclass
class Ask:
    """One checked request."""

    kind: str  # "chat" | "completion"
    prompt: Any  # chat: [{"role", "content"}]; completion: text or token ids
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # None: the server draws one (also for -1)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    cache_prompt: bool = True
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k most likely
    constraint: Constraint | None = None  # what the answer must match
    constraint_field: str | None = None  # the field that set it (named in its errors)
    tools: Tools | None = None  # the tools the model may call (chat)
    unknown: list[str] = field(default_factory=list)  # top-level fields ignored


def parse(kind: str, body: Any, max_tokens_bound: int) -> Ask:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_body")
    for key, value in body.items():
        if key in UNSUPPORTED and not (kind == "chat" and key in TOOL_FIELDS):
            if not UNSUPPORTED[key](value):
                raise bad(f"`{key}` is not supported by this server (got {value!r})", key, "unsupported_parameter")
    unknown = [key for key in body if key not in UNSUPPORTED and key not in FIELDS[kind] and key not in IGNORED]
    tools = parse_tools(body) if kind == "chat" else None
    if kind == "chat":
        prompt = _messages(body.get("messages"))
    else:
        prompt = _prompt(body.get("prompt"))
    ask = Ask(kind, prompt, unknown=unknown, tools=tools)
    ask.model = _typed(body, "model", str)
    given = [k for k in ("max_completion_tokens", "max_tokens", "n_predict") if body.get(k) is not None]
    if given:
        # llama-server's n_predict: -1 is "as many as allowed" (here: serve.max_tokens)
        ask.max_tokens = None if given[0] == "n_predict" and body["n_predict"] == -1 else \
            _int(body, given[0], 1, max_tokens_bound)
        if len({body[k] for k in given}) > 1:
            raise bad(f"give one of {', '.join(given)}, not different values", given[0])
    ask.temperature = _number(body, "temperature", 0.0, 2.0)
    ask.top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    ask.seed = None if body.get("seed") == -1 else _int(body, "seed", 0, 2**63 - 1)  # -1: random, as llama-server
    ask.top_k = _int(body, "top_k", 0, 2**31)
    ask.min_p = _number(body, "min_p", 0.0, 1.0)
    if body.get("repeat_penalty") is not None and body.get("repetition_penalty") is not None \
            and body["repeat_penalty"] != body["repetition_penalty"]:
        raise bad("give repeat_penalty or repetition_penalty, not two different values", "repeat_penalty")
    ask.repetition_penalty = _number(body, "repeat_penalty", 0.0, None, low_open=True) or \
        _number(body, "repetition_penalty", 0.0, None, low_open=True)
    ask.presence_penalty = _number(body, "presence_penalty", -2.0, 2.0)
    ask.frequency_penalty = _number(body, "frequency_penalty", -2.0, 2.0)
    ask.logit_bias = _logit_bias(body.get("logit_bias"))
    cache = _typed(body, "cache_prompt", bool)
    ask.cache_prompt = True if cache is None else cache
    ask.logprobs = _logprobs(kind, body)
    ask.stop = _stop(body.get("stop"))
    ask.stream = bool(_typed(body, "stream", bool))
    options = _typed(body, "stream_options", dict)
    if options is not None:
        if not ask.stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        unknown = sorted(set(options) - {"include_usage"})
        if unknown:
            raise bad(f"unknown field `stream_options.{unknown[0]}`", "stream_options", "unknown_parameter")
        ask.include_usage = bool(_typed(options, "include_usage", bool, "stream_options."))
    ask.constraint_field, ask.constraint = _constraint(body)
    if tools is not None and tools.calls and ask.constraint is not None:
        raise bad(f"give {tools.field_name} or {ask.constraint_field}, not both: the answer is a call or "
                  "follows the format", ask.constraint_field)
    own = _typed(body, "specfree", dict)
    if own is not None:
        unknown = sorted(set(own) - set(SPECFREE_KNOBS))
        if unknown:
            raise bad(f"unknown field `specfree.{unknown[0]}`; specfree's knobs: {', '.join(SPECFREE_KNOBS)}",
                      f"specfree.{unknown[0]}", "unknown_parameter")
        for key in ("top_k", "repetition_penalty"):
            if own.get(key) is not None and body.get(key) is not None and own[key] != body[key]:
                raise bad(f"give {key} at the top level or under specfree, not two different values", key)
        ask.top_k = _int(own, "top_k", 0, 2**31, "specfree.") if own.get("top_k") is not None else ask.top_k
        if own.get("repetition_penalty") is not None:
            ask.repetition_penalty = _number(own, "repetition_penalty", 0.0, None, "specfree.", low_open=True)
        ask.ignore_eos = bool(_typed(own, "ignore_eos", bool, "specfree."))
    return ask


def _constraint(body: dict) -> tuple[str | None, Constraint | None]:
    """The field that constrains the answer and its constraint (its shape checked; it compiles later)."""
    given = [k for k in ("response_format", "json_schema", "grammar") if body.get(k) is not None]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad(f"give one of {' and '.join(given)}: one constraint a request", given[1])
    field_name = given[0]
    value = body[field_name]
    if field_name == "grammar":
        options = {"grammar": _typed(body, "grammar", str)}
    elif field_name == "json_schema":
        options = {"json_schema": _typed(body, "json_schema", dict)}
    else:
        field_name, options = _response_format(value)
    try:
        return field_name, Constraint.from_options(**options) if options else None
    except ConfigError as exc:
        raise bad(f"`{field_name}`: {exc}", field_name) from None


def _response_format(value: Any) -> tuple[str, dict]:
    """OpenAI's ``response_format``: text, json_object (llama-server's ``schema`` inside it too) or
    json_schema ({name, schema, strict, description}); strict or not, the schema is enforced."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad("`response_format` must be an object with a `type`", "response_format", "invalid_type")
    kind, where = value["type"], "response_format"
    allowed = {"text": {"type"}, "json_object": {"type", "schema"},
               "json_schema": {"type", "json_schema"}}.get(kind)
    if allowed is None:
        raise bad(f"`response_format.type` {kind!r} is not supported; use text, json_object or json_schema",
                  "response_format.type")
    extra = sorted(set(value) - allowed)
    if extra:
        raise bad(f"unknown field `response_format.{extra[0]}` for type {kind}", f"response_format.{extra[0]}",
                  "unknown_parameter")
    if kind == "text":
        return where, {}
    if kind == "json_object":
        schema = _typed(value, "schema", dict, "response_format.")
        return (f"{where}.schema", {"json_schema": schema}) if schema is not None else (where, {"json_object": True})
    spec = _typed(value, "json_schema", dict, "response_format.")
    if spec is None:
        raise bad("`response_format.json_schema` is required for type json_schema", "response_format.json_schema",
                  "missing_required_parameter")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise bad(f"unknown field `response_format.json_schema.{extra[0]}`",
                  f"response_format.json_schema.{extra[0]}", "unknown_parameter")
    _typed(spec, "strict", bool, "response_format.json_schema.")
    _typed(spec, "name", str, "response_format.json_schema.")
    schema = _typed(spec, "schema", dict, "response_format.json_schema.")
    # OpenAI's default when a schema is left out: any JSON object
    return f"{where}.json_schema.schema", {"json_schema": schema} if schema is not None else {"json_object": True}


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` (-100..100); llama-server's ``[[id, bias], ...]`` too."""
    if value is None:
        return {}
    pairs = value.items() if isinstance(value, dict) else value if isinstance(value, list) else None
    if pairs is None:
        raise bad("`logit_bias` must be an object of token id -> bias", "logit_bias", "invalid_type")
    out = {}
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise bad("`logit_bias` as an array takes [token id, bias] pairs", "logit_bias", "invalid_type")
        token, bias = pair
        try:
            token = int(token)
        except (TypeError, ValueError):
            raise bad(f"`logit_bias` keys must be token ids, got {token!r}", "logit_bias", "invalid_type") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad(f"`logit_bias[{token}]` must be a number from -100 to 100, got {bias!r}", "logit_bias")
        out[token] = float(bias)
    return out


def _logprobs(kind: str, body: dict) -> int | None:
    """How many alternatives each token's log-probability comes with, or None (none asked)."""
    top = MAX_TOP_LOGPROBS[kind]
    if kind == "completion":  # logprobs: k (0..5)
        return _int(body, "logprobs", 0, top)
    on = _typed(body, "logprobs", bool)
    k = _int(body, "top_logprobs", 0, top)
    if k and not on:
        raise bad("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    return (k or 0) if on else None


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _typed(body: dict, key: str, kind: type, prefix: str = "") -> Any:
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise bad(f"`{prefix}{key}` must be {_kind(kind())}, got {_kind(value)}", prefix + key, "invalid_type")
    return value


def _int(body: dict, key: str, low: int, high: int | None, prefix: str = "") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"`{prefix}{key}` must be an integer, got {_kind(value)}", prefix + key, "invalid_type")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise bad(f"`{prefix}{key}` must be {bound}, got {value}", prefix + key)
    return value


def _number(body: dict, key: str, low: float, high: float | None, prefix: str = "",
            low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"`{prefix}{key}` must be a number, got {value!r}", prefix + key, "invalid_type")
    if (value <= low if low_open else value < low) or (high is not None and value > high):
        lo = f"> {low:g}" if low_open else f">= {low:g}"
        raise bad(f"`{prefix}{key}` must be {lo}{'' if high is None else f' and <= {high:g}'}, got {value}",
                  prefix + key)
    return float(value)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("`stop` must be a string or an array of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise bad(f"`stop` takes at most {MAX_STOPS} non-empty strings", "stop")
    return list(stops)


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise bad("`messages` is required", "messages", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad("`messages` must be a non-empty array of {role, content} objects", "messages", "invalid_type")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"`{where}` must be an object with role and content", where, "invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"`{where}.role` {role!r} is not supported; roles: {', '.join(ROLES)}", f"{where}.role")
        own = {"assistant": ("tool_calls", "function_call"), "tool": ("tool_call_id",)}.get(ROLES[role], ())
        for key in message:
            # an answer echoed back by a client carries refusal/audio/... as null or empty
            if key not in ("role", "content", "name", *own) and not _off(message[key]):
                raise bad(f"`{where}.{key}` is not supported by this server", f"{where}.{key}",
                          "unsupported_parameter")
        calls = [message.get(k) for k in ("tool_calls", "function_call") if not _off(message.get(k))]
        content = message.get("content")
        entry = {"role": ROLES[role], "content": "" if calls and content is None else _content(content, where)}
        if calls:
            entry["tool_calls"] = assistant_calls(calls[0], f"{where}.tool_calls")
        if entry["role"] == "tool":
            for key in ("tool_call_id", "name"):
                if message.get(key) is not None:
                    entry[key] = message[key]
            if role == "function":  # the deprecated result of a function_call: no call id to answer
                entry["tool_call_id"] = None
        out.append(entry)
    check_results(out)
    return out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"`{where}.content[{j}]`: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                          "are supported", f"{where}.content", "unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"`{where}.content` must be a string or an array of text parts, got {_kind(value)}",
              f"{where}.content", "invalid_type")


def _prompt(value: Any) -> str | list[int]:
    if value is None:
        raise bad("`prompt` is required", "prompt", "missing_required_parameter")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # one prompt in a batch of one
    if isinstance(value, str):
        if not value:
            raise bad("`prompt` is empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(t, (str, list)) for t in value):
        raise bad("several prompts in one request are not supported: send one request per prompt", "prompt",
                  "unsupported_parameter")
    raise bad("`prompt` must be a string or an array of token ids", "prompt", "invalid_type")



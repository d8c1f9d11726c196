"""Structured outputs: JSON schema, regex, choice, grammar and JSON-object constraints, enforced
with xgrammar inside continuous batching.

A request's constraint arrives as the vLLM `structured_outputs` object (`GrammarSpec` after
`parse_spec` checks its shape). `StructuredOutputs`, one per engine, turns specs into compiled
grammars: the tokenizer's vocabulary is compiled once (on the first constrained request), each
grammar once, kept in an LRU keyed by its canonical text. Compiling is thread-safe and releases
the GIL, so the serving loop compiles in a pool of its own and neither the engine thread nor
the requests without a new grammar wait for one; a grammar asked for while it compiles is
compiled once. Each constrained request owns a matcher; per step, `step_mask` fills one bitmask
for the constrained rows only, the sampler applies it before any sampling, and `advance` feeds each
accepted token back, reporting the rows whose grammar has terminated (their EOS was accepted).
While no constrained request is in the engine, steps never reach this module; steps whose
constrained requests are all waiting stop at one numpy lookup.

Preemption needs nothing: a recomputed request keeps its output tokens, and its matcher, which
has accepted exactly those tokens, stays with it.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
BOOLEAN_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
# vLLM's names for the library it enforces constraints with; anything else is refused
BACKENDS = ("xgrammar", "xgrammar:no-fallback", "xgrammar:_auto", "auto")
# vLLM's own bookkeeping, which dataclasses.asdict of its params writes (Triton's OpenAI frontend
# sends that for a tool call: StructuredOutputsParams now, GuidedDecodingParams before vLLM 0.11)
# and vLLM ignores when it reads them back
PRIVATE_FIELDS = ("_backend", "_backend_was_auto", "backend_was_auto")
UNSUPPORTED = {"whitespace_pattern": "is not supported by xgrammar (use 'disable_any_whitespace')"}
CACHE_SIZE = 256                 # compiled grammars kept per engine
# and at most this much of them (xgrammar's memory_size_bytes): a grammar of tens of thousands of
# choices holds ~100 MB, and 256 of them pinned gigabytes (vLLM bounds its xgrammar cache at 512 MB)
CACHE_BYTES = 512 * 2**20
REFUSALS_SIZE = 64               # refused constraints kept apart, so that they never evict a grammar
# "[15:12:11] /project/cpp/x.cc:94: ", and the assertion before a structural tag's error
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Check failed: .*? is false: )?")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint in canonical form: `text` is the compact JSON of a schema or of a choice
    list, the regex, or the grammar ('' for json_object)."""
    kind: str
    text: str
    any_whitespace: bool = True
    param: str = field(default="structured_outputs", compare=False)   # the parameter's name, for errors

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.text, self.any_whitespace


def parse_spec(value, name: str = "structured_outputs") -> GrammarSpec:
    """Check the shape of a `structured_outputs` value (an object, or its JSON text) and return
    its canonical spec. Raises ValueError naming the field; grammars are checked by compiling."""
    if isinstance(value, GrammarSpec):
        return value
    value = json_value(value, name)
    if not isinstance(value, dict):
        raise ValueError(f"'{name}' must be an object with one of the keys {', '.join(KINDS)}; "
                         f"got {type(value).__name__}")
    value = {k: v for k, v in value.items() if v is not None and k not in PRIVATE_FIELDS}
    unknown = sorted(set(value) - set(KINDS) - set(BOOLEAN_OPTIONS) - set(UNSUPPORTED) - {"backend"})
    if unknown:
        raise ValueError(f"'{name}' has unknown key(s) {unknown}; known: "
                         f"{sorted(KINDS + BOOLEAN_OPTIONS) + ['backend']}")
    for key, problem in UNSUPPORTED.items():
        if key in value:
            raise ValueError(f"'{name}.{key}' {problem}")
    backend = value.get("backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"'{name}.backend' must be 'xgrammar' or 'auto' (constraints are enforced with "
                         f"xgrammar here), got {backend!r}")
    for option in BOOLEAN_OPTIONS:
        if not isinstance(value.get(option, False), bool):
            raise ValueError(f"'{name}.{option}' must be a boolean, got {value[option]!r}")
    kinds = [k for k in KINDS if k in value]
    if len(kinds) != 1:
        raise ValueError(f"'{name}' must give exactly one of {', '.join(KINDS)}; got "
                         f"{', '.join(kinds) if kinds else 'none'}")
    kind = kinds[0]
    text = _canonical_text(kind, value[kind], f"{name}.{kind}")
    return GrammarSpec(kind, text, not value.get("disable_any_whitespace", False), name)


# vLLM's bounds on how deeply a schema's (and a structural tag's) objects and arrays nest: xgrammar's
# compile time grows fast with depth (a 900-level tag took 35 s in the pool every grammar shares)
MAX_SCHEMA_DEPTH, MAX_TAG_DEPTH = 64, 64 + 16


def _check_depth(value, name: str, limit: int) -> None:
    """ValueError naming the field where JSON objects and arrays nest more than `limit` levels deep
    (iterative: any depth)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                raise ValueError(f"'{name}' is nested too deeply: objects and arrays may nest at most {limit} "
                                 "levels (vLLM's limit)")
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def _structural_tag(value, name: str) -> dict:
    """A structural tag as vLLM takes one: xgrammar's format, {"type": "structural_tag", "format":
    {...}} (checked by compiling), or the older {"structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}, whose shape is checked here."""
    if not isinstance(value, dict):
        raise ValueError(f"'{name}' must be an object, got {type(value).__name__}")
    _check_depth(value, name, MAX_TAG_DEPTH)
    if "structures" not in value:
        return value
    structures, triggers = value["structures"], value.get("triggers")
    if not isinstance(structures, list) or not all(
            isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
            and isinstance(s.get("schema"), dict) for s in structures):
        raise ValueError(f"'{name}.structures' must be a list of objects with 'begin' and 'end' strings and a "
                         "'schema' object")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"'{name}.triggers' must be a list of non-empty strings")
    return value


def json_value(value, name: str):
    """`value` itself, or the value its JSON text holds (a string): either form is accepted. A text
    that is not JSON raises ValueError naming the field."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:           # also an integer longer than Python converts (4,300 digits)
        raise ValueError(f"'{name}' is not valid JSON: {getattr(exc, 'msg', exc)}") from None
    except RecursionError:
        raise ValueError(f"'{name}' is nested too deeply") from None


def _canonical_text(kind: str, value, name: str) -> str:
    if kind == "json":
        value = json_value(value, name)
        if not isinstance(value, dict):
            raise ValueError(f"'{name}' must be a JSON schema object, got {type(value).__name__}")
        _check_depth(value, name, MAX_SCHEMA_DEPTH)
        try:
            problem = unenforced(value)
        except RecursionError:          # $ref chains: depth the nesting does not show
            raise ValueError(f"'{name}' is nested too deeply") from None
        if problem is not None:      # vLLM refuses these for xgrammar too (it falls back to another library)
            raise ValueError(f"'{name}' {problem}, which xgrammar would not enforce: the output could break "
                             "the schema")
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)   # key order kept: it orders the output
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"'{name}' must be true, got {value!r}")
        return ""
    if kind == "structural_tag":
        return json.dumps(_structural_tag(json_value(value, name), name), separators=(",", ":"), ensure_ascii=False)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ValueError(f"'{name}' must be a list of strings")
        if not value:
            raise ValueError(f"'{name}' is empty: give at least one string")
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise ValueError(f"'{name}' must be a non-empty string")
    return value


# what xgrammar (0.2.9) compiles a JSON schema's "format" into; any other format it lets through as any string
XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# format names that ask nothing a validator checks (pydantic's for SecretStr, bytes and Path), which
# xgrammar takes as any string; any other name it does not know is refused (as vLLM refuses it):
# pydantic validates its own (ipvanyaddress, multi-host-uri, ...) and rejects any string there
FREE_FORMATS = frozenset({"password", "binary", "path"})
# the formats of XGRAMMAR_FORMATS whose grammar never writes an empty string, so a "minLength": 1
# beside them (pydantic's AnyUrl) holds though xgrammar drops it
_NEVER_EMPTY_FORMATS = XGRAMMAR_FORMATS - {"uri-reference", "uri-template", "json-pointer"}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties")
# keywords that say what a value is: without one of these xgrammar takes a schema as any value,
# dropping the type-specific keywords below
_TYPING = ("type", "$ref", "enum", "const", "anyOf", "oneOf", "allOf", "properties", "additionalProperties",
           "patternProperties", "items", "prefixItems")
_TYPE_SPECIFIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                  "maxLength", "pattern", "format", "required", "minProperties", "maxProperties", "minItems",
                  "maxItems", "uniqueItems", "contains")
# JSON Schema's assertion and applicator keywords: what a validator enforces. Any other key (title,
# example, $defs, x- extensions, OpenAPI's nullable and discriminator) is a note no output can break
_RULES = frozenset({"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
                    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "items", "prefixItems",
                    "additionalItems", "contains", "maxItems", "minItems", "uniqueItems", "maxContains",
                    "minContains", "properties", "patternProperties", "additionalProperties", "propertyNames",
                    "required", "maxProperties", "minProperties", "dependentRequired", "dependentSchemas",
                    "dependencies", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
                    "unevaluatedItems", "unevaluatedProperties"})


# keywords xgrammar drops wherever they stand (measured; "uniqueItems": false asks nothing)
_IGNORED = ("uniqueItems", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
            "dependencies")
# keywords whose list JSON Schema requires to be non-empty; xgrammar takes an empty one as any value
_NON_EMPTY_LISTS = ("type", "enum", "allOf", "anyOf", "oneOf")
# keywords that decide a value alone: xgrammar drops any rule beside them (pydantic writes 'type'
# next to 'enum' and 'const', OpenAPI's generators next to a '$ref': served where they imply it;
# pydantic 2.7-2.9 a one-value 'enum' next to 'const')
_DECIDING = ("$ref", "allOf", "enum", "const", "anyOf", "oneOf")


def unenforced(schema, path: str = "", root=None) -> str | None:
    """What in a JSON schema xgrammar would compile away (measured: it accepts output that breaks
    it), with where it is; None if nothing. Checked: an empty `type`, `enum`, `allOf`, `anyOf` or
    `oneOf` (any value), `not` and `if`/`then`/`else` (ignored), a `format` outside
    XGRAMMAR_FORMATS and FREE_FORMATS (any string), a `pattern` or known `format` with `minLength`
    (but 1 beside a format that is never empty) or `maxLength` (the lengths dropped), a `pattern`
    with a known `format` (the pattern dropped), an `allOf` of several schemas (any value), a rule
    (not a note such as `example`) next to a `$ref`, a one-schema `allOf`, `enum`, `const`, `anyOf`
    or `oneOf` (dropped; a `type` there only where they imply it), a type-specific
    keyword without anything that types the schema (any value), a `required` name its `properties`
    lack (not enforced), the _IGNORED keywords, `multipleOf` on a non-integer, `propertyNames`
    with `properties` or `patternProperties` (vLLM refuses most of these for xgrammar too), and a
    pattern matching a character JSON escapes (written raw: invalid JSON; vLLM lets it through)."""
    if not isinstance(schema, dict):
        return None
    root = schema if root is None else root
    where = path or "the top level"
    empty = [k for k in _NON_EMPTY_LISTS if schema.get(k) == []]
    if empty:
        return f"gives an empty '{empty[0]}' at {where}"
    for keyword in ("not", "if", "then", "else"):
        if keyword in schema:
            return f"uses '{keyword}' at {where}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"uses 'allOf' of {len(schema['allOf'])} schemas at {where} (merge them into one)"
    said_twice = isinstance(schema.get("enum"), list) and "const" in schema and schema["const"] in schema["enum"]
    for keyword in _DECIDING:
        rules = sorted((set(schema) & _RULES) - {keyword, "type"} - ({"enum", "const"} if said_twice else set()))
        if keyword in schema and rules:
            return f"gives {', '.join(repr(r) for r in rules)} next to '{keyword}' at {where}"
    if (outside := _outside_type(schema, root)) is not None:
        return (f"gives 'type' {json.dumps(schema['type'])} next to values or branches outside it at {where} "
                f"({outside})")
    ignored = [k for k in _IGNORED if k in schema and not (k == "uniqueItems" and schema[k] is False)]
    if ignored:
        return f"uses '{ignored[0]}' at {where}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"uses 'multipleOf' on a type other than 'integer' at {where}"
    if "propertyNames" in schema and (shaped := [k for k in ("properties", "patternProperties") if k in schema]):
        return f"combines 'propertyNames' with '{shaped[0]}' at {where}"
    if not any(k in schema for k in _TYPING):
        untyped = [k for k in _TYPE_SPECIFIC if k in schema]
        if untyped:
            return f"uses '{untyped[0]}' without a 'type' at {where}"
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema["required"] if isinstance(schema.get("required"), list) else []
    missing = [name for name in required if isinstance(name, str) and name not in properties]
    if missing:
        return f"requires {missing[0]!r} at {where}, which its 'properties' do not define"
    form = schema.get("format")
    if "format" in schema and (not isinstance(form, str) or form not in XGRAMMAR_FORMATS | FREE_FORMATS):
        return (f"uses the format {form!r} at {where} (known: {', '.join(sorted(XGRAMMAR_FORMATS))}; any string: "
                f"{', '.join(sorted(FREE_FORMATS))})")
    shapes = [k for k in ("pattern", "format") if k in schema and (k == "pattern" or form in XGRAMMAR_FORMATS)]
    if len(shapes) == 2:
        return f"combines 'pattern' with 'format' at {where}"
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    if shapes == ["format"] and form in _NEVER_EMPTY_FORMATS and schema.get("minLength") in (0, 1):
        lengths.remove("minLength")
    if lengths and shapes:
        return f"combines '{shapes[0]}' with '{lengths[0]}' at {where}"
    patterns = [("'pattern'", schema["pattern"])] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [("'patternProperties' key", name) for name in schema["patternProperties"]]
    for keyword, pattern in patterns:
        if (char := _json_escaped_literal(pattern)) is not None:
            return (f"has a {keyword} at {where} matching {json.dumps(char)} literally, a character JSON "
                    "escapes (xgrammar writes it raw: invalid JSON)")
    children = [(f"{path}/{key}/{name}", sub) for key in _SUBSCHEMA_MAPS if isinstance(schema.get(key), dict)
                for name, sub in schema[key].items()]
    children += [(f"{path}/{key}/{i}", sub) for key in _SUBSCHEMA_LISTS if isinstance(schema.get(key), list)
                 for i, sub in enumerate(schema[key])]
    children += [(f"{path}/{key}", schema[key]) for key in _SUBSCHEMAS if isinstance(schema.get(key), dict)]
    if isinstance(schema.get("propertyNames"), dict):       # a key is a string: typed, if it says not
        children = [(p, {"type": "string", **sub} if p.endswith("/propertyNames") else sub) for p, sub in children]
    return next(filter(None, (unenforced(sub, sub_path, root) for sub_path, sub in children)), None)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "integer"
    return {float: "number", str: "string", list: "array"}.get(type(value), "object")


def _named_types(schema, root: dict, depth: int = 0) -> set[str] | None:
    """The types a schema allows as xgrammar reads it: by its 'type', its only values ('const',
    'enum'), the object or array keywords that make it one there, or what its local '$ref' (or
    one-schema 'allOf') names; None if unsaid."""
    if not isinstance(schema, dict) or depth > 32:      # a $ref cycle names nothing
        return None
    if isinstance(schema.get("$ref"), str):
        return _named_types(_local_ref(root, schema["$ref"]), root, depth + 1)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
        return _named_types(schema["allOf"][0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, (str, list)):
        return {kind} if isinstance(kind, str) else set(kind)
    if "const" in schema:
        return {_json_type(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_json_type(value) for value in schema["enum"]}
    if any(k in schema for k in ("properties", "additionalProperties", "patternProperties")):
        return {"object"}
    if any(k in schema for k in ("items", "prefixItems")):
        return {"array"}
    return None


def _local_ref(root: dict, ref: str):
    """The schema a '#/...' JSON pointer names in the document; None for another document's."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _outside_type(schema: dict, root: dict) -> str | None:
    """What a 'type' beside 'enum', 'const', 'anyOf', 'oneOf', '$ref' or a one-schema 'allOf' does
    not cover: xgrammar keeps only those and drops the type (measured), so it holds only where
    they already imply it."""
    kind = schema.get("type")
    if not isinstance(kind, (str, list)):
        return None
    types = {kind} if isinstance(kind, str) else set(kind)

    def covered(named: str) -> bool:
        return named in types or named == "integer" and "number" in types
    values = [("const", schema["const"])] if "const" in schema else []
    values += [("enum", value) for value in schema["enum"]] if isinstance(schema.get("enum"), list) else []
    for keyword, value in values:
        if not covered(_json_type(value)):
            return f"its '{keyword}' value {json.dumps(value)}"
    for keyword in ("anyOf", "oneOf"):
        for i, branch in enumerate(schema.get(keyword) if isinstance(schema.get(keyword), list) else []):
            kinds = _named_types(branch, root)
            if kinds is None or not all(map(covered, kinds)):
                return f"its '{keyword}' branch {i}, which names no type within it"
    if "$ref" in schema or "allOf" in schema:
        kinds = _named_types({k: schema[k] for k in ("$ref", "allOf") if k in schema}, root)
        if kinds is None or not all(map(covered, kinds)):
            return f"its '{'$ref' if '$ref' in schema else 'allOf'}', which names no type within it"
    return None


# escapes of a regex (ECMA-262, as JSON schema's) that stand for one character, by the letter
_REGEX_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}
_REGEX_CODE_ESCAPE = re.compile(r"x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|c([A-Za-z])")


def _escaped_json(code: int) -> bool:
    """Whether JSON writes this character escaped: a quote, a backslash or a control character."""
    return code < 0x20 or code in (0x22, 0x5C)


def _regex_item(pattern: str, i: int, in_class: bool) -> tuple[int | None, int]:
    """The character at pattern[i] (code point), or None for a class escape, an anchor or another
    item that is no single character; and where the next item begins."""
    if pattern[i] != "\\" or i + 1 == len(pattern):
        return ord(pattern[i]), i + 1
    if code := _REGEX_CODE_ESCAPE.match(pattern, i + 1):
        return (ord(code[3]) % 32 if code[3] else int(code[1] or code[2], 16)), i + 1 + len(code[0])
    letter = pattern[i + 1]
    if letter == "b" and in_class:              # a backspace there, a word boundary outside
        return 8, i + 2
    if letter in _REGEX_ESCAPES:
        return ord(_REGEX_ESCAPES[letter]), i + 2
    if letter.isalnum():                        # \d, \b, \B, \1 (a back-reference), \p{...}: not one character
        return None, i + 2
    return ord(letter), i + 2                   # an escaped punctuation or control character: itself


def _json_escaped_literal(pattern: str) -> str | None:
    """The first quote, backslash or control character a pattern matches literally; None if none.
    xgrammar 0.2.9 writes such a character into the JSON string as it is ('^a"b$' lets '"a"b"'
    through, '^a\\nb$' a raw newline), also a [class] of nothing else; a class with any other
    member, a range, `.` or `\\S` it limits to JSON's characters, and a negated class excludes them."""
    i = 0
    while i < len(pattern):
        if pattern[i] != "[":
            code, i = _regex_item(pattern, i, in_class=False)
            if code is not None and _escaped_json(code):
                return chr(code)
            continue
        negated = pattern.startswith("^", i + 1)
        i += 1 + negated
        members: list[tuple[int, int] | None] = []        # (first, last) code points; None: a class escape
        while i < len(pattern) and pattern[i] != "]":
            first, i = _regex_item(pattern, i, in_class=True)
            last = first
            if first is not None and pattern.startswith("-", i) and i + 1 < len(pattern) and pattern[i + 1] != "]":
                last, i = _regex_item(pattern, i + 1, in_class=True)
            members.append(None if first is None or last is None else (first, last))
        i += 1
        if negated or not members:
            continue
        if all(m is not None and m[1] <= 0x5C and all(map(_escaped_json, range(m[0], m[1] + 1))) for m in members):
            return chr(members[0][0])         # nothing else in the class: xgrammar writes it raw
    return None


# xgrammar 0.2.9 writes a string with minLength/maxLength as a run of this character class, which
# lets raw control characters (U+0000-U+001F but CR and LF) into the JSON: text json.loads refuses
# (mlc-ai/xgrammar#286); its other strings exclude them, as below
_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n]'


# xgrammar 0.2.9 prints U+0080-U+00FF as \xHH, and its EBNF parser reads \x with every hex digit
# after it: "é1" came back as U+0E91 (a schema's "café1", an enum's "décembre", a pattern's [é1]).
# Rewritten as \u00HH, which has a fixed length; an escaped backslash before it is left alone.
_LATIN1_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")


def json_schema_grammar(schema: str, any_whitespace: bool) -> str:
    """xgrammar's EBNF for a JSON schema, its length-bounded strings' characters made JSON's and
    its Latin-1 escapes read back as printed. Without free whitespace the JSON is compact, no space
    after ',' or ':' (vLLM asks xgrammar for those separators; its own default has a space after each)."""
    import xgrammar as xgr
    separators = None if any_whitespace else (",", ":")
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, separators=separators))
    ebnf = _LATIN1_ESCAPE.sub(r"\1\\u00\2", ebnf)
    return ebnf.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A constraint xgrammar refused, cached as such: sent again, by any field, it is refused
    without compiling again (a schema 300 levels deep takes ~2.7 s to fail here)."""
    reason: str                      # "is not a valid JSON schema: <xgrammar's message>"

    def raise_for(self, spec: GrammarSpec):
        raise ValueError(f"'{spec.param}.{spec.kind}' {self.reason}")


def _compile_structural_tag(compiler, text: str, any_whitespace: bool):
    """The older form ({"structures", "triggers"}) as the triggered tags it stands for (vLLM reads
    it so). Without any_whitespace, a JSON inside the tag may put at most one whitespace character
    between its tokens where the tag does not say (xgrammar has no compact form for a tag's JSON;
    vLLM leaves tags alone): a small model can otherwise spend max_tokens on whitespace."""
    tag = json.loads(text)
    if "structures" in tag:
        tag = {"type": "structural_tag", "format": older_tag_format(tag)}
    if not any_whitespace:
        bound_whitespace(tag)
    return compiler.compile_structural_tag(json.dumps(tag))


def older_tag_format(tag: dict) -> dict:
    """The format an older structural tag ({"structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}) stands for: triggered tags of JSON contents, as vLLM reads it. Also the
    OpenAI server's, which joins a tag with the tool-call envelope."""
    return {"type": "triggered_tags", "triggers": tag.get("triggers"), "tags": [
        {"type": "tag", "begin": s.get("begin"), "content": {"type": "json_schema", "json_schema": s.get("schema")},
         "end": s.get("end")} for s in tag["structures"]]}


def bound_whitespace(tag: dict) -> dict:
    """The tag with each JSON inside it allowed one whitespace character at most between tokens
    (max_whitespace_cnt 1) where it does not say: disable_any_whitespace for a structural tag, in
    place. Also the OpenAI server's, for the tags it sends (vLLM's engine leaves a tag's whitespace
    free)."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and node.get("type") == "json_schema" and node.get("max_whitespace_cnt") is None:
            node["max_whitespace_cnt"] = 1
        stack.extend(node.values() if isinstance(node, dict) else node if isinstance(node, list) else ())
    return tag


class StructuredOutputs:
    """Per engine: the compiler (built on first use from the model's tokenizer), the LRU of
    compiled grammars and one of refused constraints, and the step's bitmask buffer."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], max_num_seqs: int,
                 device=None, reasoning=None):
        self._tokenizer = tokenizer          # a transformers tokenizer, or None for a checkpoint without one
        self.reasoning = reasoning           # reasoning.Reasoning: grammars wait for its end marker; None: never
        self.vocab_size = vocab_size         # the model's (logits) vocabulary, maybe padded past the tokenizer's
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_num_seqs = max_num_seqs
        self.device = device
        self._lock = threading.Lock()        # the cache and the compiles in progress
        self._compiler_lock = threading.Lock()   # building the compiler (reads the whole vocabulary: seconds)
        self._compiler = None
        self._compiling: dict[tuple, Future] = {}   # spec key: asked again, it waits for this compile
        self._terminate_without_stop = False
        self._cache: OrderedDict = OrderedDict()
        self.cache_bytes = 0                 # what the cached grammars hold
        self._refused: OrderedDict = OrderedDict()
        self._bitmask = None                 # [max_num_seqs, ceil(vocab / 32)] int32, allocated on first use
        self._batch = None
        self.num_compiled = 0                # grammars compiled (cache misses)
        self.mask_seconds = 0.0              # time spent filling, applying and advancing masks
        self.mask_steps = 0

    # ---- compiling (any thread) ------------------------------------------------------------------
    def compile(self, spec: GrammarSpec):
        """The compiled grammar for a spec, from the cache or compiled now (on the calling thread).
        Raises ValueError naming the field, with xgrammar's message."""
        key = spec.key
        with self._lock:
            compiled = self._hit(spec)
            if compiled is not None:
                return compiled
            earlier = self._compiling.get(key)
            if earlier is None:
                running = self._compiling[key] = Future()
        if earlier is not None:
            return self._usable(earlier.result(), spec)   # its result, or its error
        try:
            compiled = self._compile(self._compiler or self._make_compiler(spec.param), spec)
        except BaseException as exc:
            with self._lock:
                del self._compiling[key]
            running.set_exception(exc)
            raise
        with self._lock:
            self.num_compiled += 1
            if isinstance(compiled, Refusal):
                self._refused[key] = compiled
                while len(self._refused) > REFUSALS_SIZE:
                    self._refused.popitem(last=False)
            else:
                self._keep(key, compiled)
            del self._compiling[key]
        running.set_result(compiled)
        return self._usable(compiled, spec)

    def cached(self, spec: GrammarSpec):
        """The compiled grammar for a spec if the cache has it, else None (never compiles nor waits
        for a compile). Raises ValueError naming the field for a constraint refused before."""
        with self._lock:
            return self._hit(spec)

    def _keep(self, key: tuple, compiled) -> None:
        """Cache a grammar, evicting the least recently used past CACHE_SIZE or CACHE_BYTES (the
        newest stays, whatever its size: its requests hold it anyway)."""
        self._cache[key] = compiled
        self.cache_bytes += compiled.memory_size_bytes
        while len(self._cache) > CACHE_SIZE or (self.cache_bytes > CACHE_BYTES and len(self._cache) > 1):
            _, evicted = self._cache.popitem(last=False)
            self.cache_bytes -= evicted.memory_size_bytes

    def _hit(self, spec: GrammarSpec):
        for kept in (self._cache, self._refused):
            compiled = kept.get(spec.key)
            if compiled is not None:
                kept.move_to_end(spec.key)
                return self._usable(compiled, spec)
        return None

    @staticmethod
    def _usable(compiled, spec: GrammarSpec):
        if isinstance(compiled, Refusal):
            compiled.raise_for(spec)
        return compiled

    def _make_compiler(self, name: str):
        with self._compiler_lock:             # once, whoever asks first; the cache stays free meanwhile
            return self._compiler or self._build_compiler(name)

    def _build_compiler(self, name: str):
        import xgrammar as xgr
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise ValueError(f"'{name}' needs the model's tokenizer, and this engine has none")
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.stop_token_ids) or None)
        except Exception as exc:               # a tokenizer xgrammar cannot read
            raise ValueError(f"'{name}' cannot be enforced with this model's tokenizer: {exc}") from None
        # without any stop token a matcher ends as soon as its grammar is complete
        self._terminate_without_stop = not info.stop_token_ids
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    @staticmethod
    def _compile(compiler, spec: GrammarSpec):
        """The compiled grammar, or the Refusal of a constraint xgrammar cannot compile."""
        what = {"json": "a valid JSON schema", "json_object": "valid", "regex": "a valid regex",
                "grammar": "a valid grammar", "choice": "a valid choice list",
                "structural_tag": "a valid structural tag"}[spec.kind]
        try:
            if spec.kind == "structural_tag":
                return _compile_structural_tag(compiler, spec.text, spec.any_whitespace)
            if spec.kind in ("json", "json_object"):
                schema = spec.text if spec.kind == "json" else '{"type": "object"}'
                return compiler.compile_grammar(json_schema_grammar(schema, spec.any_whitespace))
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec.text)))
            if "::=" in spec.text:
                return compiler.compile_grammar(spec.text)
            return compiler.compile_lark(spec.text)         # vLLM takes Lark grammars too
        except Exception as exc:          # xgrammar raises RuntimeError/ValueError with a parser message
            return Refusal(f"is not {what}: {_LOG_PREFIX.sub('', str(exc).strip())}")

    def new_matcher(self, compiled):
        import xgrammar as xgr
        return xgr.GrammarMatcher(compiled, terminate_without_stop_token=self._terminate_without_stop)

    def waits(self, matcher, prompt: list[int]) -> bool:
        """Whether a request's grammar waits for the end of the model's reasoning to start."""
        return matcher is not None and self.reasoning is not None and self.reasoning.open_after(prompt)

    # ---- the step (engine thread) ------------------------------------------------------------------
    def step_mask(self, table, sample_rows: np.ndarray) -> "StepMask | None":
        """The bitmask of this step's constrained sampling rows, or None if it has none. The rows
        whose grammar waits for the end of reasoning are unmasked, and watched for it."""
        rows = np.flatnonzero(table.constrained[sample_rows])
        if not rows.size:
            return None
        started = time.perf_counter()
        if self._bitmask is None:
            self._allocate()
        positions, matchers, reasoning = [], [], []
        for i in rows.tolist():
            req = table.requests[int(sample_rows[i])]
            if req.reasoning:
                reasoning.append((i, req))
            else:
                positions.append(i)
                matchers.append(req.matcher)
        if positions:
            self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, positions)
        bitmask = self._bitmask[:len(sample_rows)]
        if self.device is not None and self.device.type != "cpu" and positions:
            bitmask = bitmask.to(self.device, non_blocking=True)
        mask = StepMask(positions, matchers, bitmask, self, reasoning)
        self.mask_seconds += time.perf_counter() - started
        self.mask_steps += 1
        return mask

    def _allocate(self) -> None:
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(self.max_num_seqs, self.vocab_size)
        if self.device is not None and self.device.type == "cuda":
            bitmask = bitmask.pin_memory()
        self._bitmask = bitmask
        self._batch = xgr.BatchGrammarMatcher()


@dataclass(slots=True, eq=False)
class StepMask:
    """One step's constraint: which sampling rows are constrained, their matchers, their bitmask.
    Called by the sampler on the logits; then `advance` with the sampled tokens."""
    positions: list[int]             # indices into the step's sampling rows
    matchers: list
    bitmask: object                  # torch int32 [num sampling rows, ceil(vocab / 32)]
    owner: StructuredOutputs
    reasoning: list[tuple[int, object]] = field(default_factory=list)   # (position, request): unmasked, reasoning
    rejected: list[int] = field(default_factory=list)   # positions whose token the grammar refused

    def __call__(self, logits) -> None:
        """Set every token outside each constrained row's grammar to -inf, in place."""
        import torch
        import xgrammar as xgr
        if not self.positions:
            return
        started = time.perf_counter()
        if logits.dtype in (torch.float32, torch.float16, torch.bfloat16):     # what xgrammar's kernels take
            xgr.apply_token_bitmask_inplace(logits, self.bitmask, indices=self.positions)
        else:    # float64 (exactness runs): the kernel writes the -inf pattern into a float32 bias
            bias = torch.zeros((len(self.positions), logits.shape[1]), dtype=torch.float32, device=logits.device)
            xgr.apply_token_bitmask_inplace(bias, self.bitmask[self.positions])
            index = torch.tensor(self.positions, device=logits.device)
            logits[index] += bias.to(logits.dtype)
        self.owner.mask_seconds += time.perf_counter() - started

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        """Feed each constrained row its sampled token; True for rows whose grammar has terminated
        (or that produced a token the grammar refused: see `rejected`), in sampling-row order."""
        started = time.perf_counter()
        done = np.zeros(len(tokens), dtype=bool)
        for i, req in self.reasoning:
            req.reasoning = not self._ends_reasoning(req.matcher, int(tokens[i]))
        for i, matcher in zip(self.positions, self.matchers):
            if not matcher.accept_token(int(tokens[i])):
                self.rejected.append(i)
                done[i] = True
            elif matcher.is_terminated():
                done[i] = True
        self.owner.mask_seconds += time.perf_counter() - started
        return done

    def _ends_reasoning(self, matcher, token: int) -> bool:
        """The end marker ends the wait, and the grammar starts after it. A tool call's opening (qwen3)
        ends it as the grammar's first token, as vLLM feeds it to its grammar; where the grammar
        cannot start with it (a response_format), the wait goes on to the end marker (vLLM's grammar
        would refuse the token)."""
        markers = self.owner.reasoning
        if token == markers.end_id:
            return True
        return token == markers.tool_start_id and matcher.accept_token(token)

"""Reading hsched's YAML (and JSON: it is YAML) files: task and job files, fleets, slice types, tokens, tenant
weights. Every reader parses with this module's loader, so a file it refuses is one line naming the file, never a
traceback, and each rule is worded once:

- PyYAML composes nodes recursively (10,000 `[` were a RecursionError), so nesting is capped at MAX_DEPTH;
- its constructors raise plain ValueError, IndexError, ... on a value they cannot make (`2020-13-45` looks like a
  date, `!!int x`, an empty `!!float`): each becomes a rule naming the value and its line;
- it keeps the last of a mapping's repeated keys silently (`name: x` then `name: y` is y): a repeated key is refused;
- a file that is not UTF-8 text, or not YAML, is one line saying where.

Numbers: YAML 1.1 (PyYAML's) reads `1e5` and `5e-324` (no dot) as strings, but JSON writers emit them
(json.dumps(1e20) is `1e+20`), so by default numbers are read as YAML 1.2 and JSON read them. `json_numbers=False`
keeps YAML 1.1's reading, for files of strings written by yaml.safe_dump (which writes the string `1e5` unquoted).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from hsched.domain.errors import ValidationError, shown

MAX_DEPTH = 32  # nesting levels a file may have: a task file needs 4 (a list, a spec, resources, a value), a fleet 7


class YamlFileError(ValidationError):
    """A file that is not readable YAML: `field` (and `file`) is the file's name, `rule` the one-line reason."""

    def __init__(self, file: str, rule: str) -> None:
        super().__init__(file, rule)
        self.file = file


class _Refused(yaml.YAMLError):
    """A file the loader refuses for a rule of its own, not its YAML syntax: the message is the whole rule."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with the module's rules: nesting capped, a repeated key or an unmakeable value refused."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _Refused(f"nests deeper than {MAX_DEPTH} levels (line {self.peek_event().start_mark.line + 1}): "
                               "an hsched file needs a handful")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        lines: dict[tuple[str, str], int] = {}
        for key, _ in node.value:  # as written, before `<<` merges (whose keys a mapping may override) are applied
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if (key.tag, key.value) in lines:
                    raise _Refused(f"duplicate key {shown(key.value)} on line {line} (first on line "
                                   f"{lines[key.tag, key.value]}): a mapping's keys must be unique")
                lines[key.tag, key.value] = line
        return node

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, AttributeError, LookupError) as exc:  # a ValueError says why; others are PyYAML's
            why = f" ({exc})" if isinstance(exc, ValueError) else ""
            raise _Refused(f"{shown(node.value)} on line {node.start_mark.line + 1} is not a valid "
                           f"{node.tag.rpartition(':')[2]}{why}") from None


class _JsonNumbersLoader(_Loader):
    """_Loader reading numbers as YAML 1.2 and JSON do (the module docstring)."""


class YamlDumper(yaml.SafeDumper):
    """PyYAML's SafeDumper with _JsonNumbersLoader's rule: it quotes a string such as `0e0` (a valid tenant), which it
    would write bare as YAML 1.1 text and the loader would read back as a number."""


for _cls in (_JsonNumbersLoader, YamlDumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))


def read_text(path: str | Path) -> str:
    """The file's text; YamlFileError if it is not UTF-8. OSError (missing, unreadable) is the caller's to word:
    each names its flag."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise YamlFileError(str(path), f"is not UTF-8 text (byte {exc.start})") from None


def documents(text: str, file: str, *, json_numbers: bool = True) -> list[Any]:
    """Every document of a YAML stream (`---`-separated; an empty one is None); YamlFileError naming `file`."""
    try:
        return list(yaml.load_all(text, Loader=_JsonNumbersLoader if json_numbers else _Loader))
    except _Refused as exc:
        raise YamlFileError(file, str(exc)) from None
    except yaml.YAMLError as exc:
        raise YamlFileError(file, _syntax(exc)) from None


def document(text: str, file: str, *, json_numbers: bool = True) -> Any:
    """The file's one document (None if it has none), as yaml.safe_load reads it; YamlFileError naming `file`, also
    for several documents."""
    docs = [d for d in documents(text, file, json_numbers=json_numbers) if d is not None]  # a stray `---` is empty
    if len(docs) > 1:
        raise YamlFileError(file, "holds several YAML documents (---): it must be one")
    return docs[0] if docs else None


def _syntax(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: where (line, column) and what, without its `in "<unicode string>"` marks."""
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML forbids (a control character): no line to name
        return f"is not valid YAML: character {exc.position + 1} is #x{exc.character:04x} ({exc.reason})"
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return f"is not valid YAML: {' '.join(str(exc).split())}"
    what = ", ".join(filter(None, (getattr(exc, "context", None), getattr(exc, "problem", None))))
    return f"is not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {what}"

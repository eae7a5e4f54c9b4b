"""Reading the user's input files with errors that name the file, the line and the fix.

Every problem with an input file is raised as a `FileNotFoundError` (it does not exist) or a `ValueError` (it cannot
be parsed), which `longspark` reports as one line instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from difflib import get_close_matches
from pathlib import Path
from typing import Any

import yaml

_HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")


def looks_like_hub_id(name: str | os.PathLike) -> bool:
    """Whether `name` could be a Hub repository id (`name` or `org/name`) rather than only a local path."""
    return isinstance(name, str) and _HUB_ID.fullmatch(name) is not None and ".." not in name


CACHE_ENV = "LONGSPARK_CACHE"


def cache_root() -> Path:
    """The package's cache folder (the de-quantized demo target, calibrations): ``$LONGSPARK_CACHE``, else
    ``~/.cache/transformers-longspark``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "transformers-longspark")


TARGET_FOLDER_FIX = "pass a model folder saved with `save_pretrained`, a Hub id, or no target for the SmolLM2 demo."
DRAFTER_FOLDER_FIX = (
    "pass a folder saved by `longspark train` (it holds config.json and model.safetensors), or no "
    "drafter for the default."
)


def require_folder(name: str | os.PathLike, what: str, fix: str) -> None:
    """A missing local model folder fails here, at once, with "<what> folder <name> does not exist; <fix>"; a name
    that may be a Hub id is left to `from_pretrained`."""
    if not Path(name).exists() and not looks_like_hub_id(name):
        raise FileNotFoundError(f"{what} folder {name} does not exist; {fix}")


def require_path(path: str | os.PathLike, what: str, fix: str) -> Path:
    """`Path(path)`, or a `FileNotFoundError` "<what> <path> does not exist; <fix>"."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist; {fix}")
    return path


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {path} is not UTF-8 text ({error.reason} at byte {error.start}).") from error


def _parse(path: str | os.PathLike, what: str, parse: Callable[[str], Any], errors, problem: Callable) -> Any:
    """`parse` of the file's text; a parse error `e` raises "<what> <path> is not valid <problem(e)>. Fix the file."."""
    path = require_path(path, what, "check the path.")
    try:
        return parse(_read_text(path, what))
    except errors as error:
        raise ValueError(f"{what} {path} is not valid {problem(error)}. Fix the file.") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"YAML{where}: {getattr(error, 'problem', None) or error}"


def read_yaml(path: str | os.PathLike, what: str = "File") -> Any:
    """A YAML (or JSON) file's content."""
    return _parse(path, what, yaml.safe_load, yaml.YAMLError, _yaml_problem)


def read_json(path: str | os.PathLike, what: str = "File") -> Any:
    """A JSON file's content."""
    return _parse(
        path, what, json.loads, json.JSONDecodeError, lambda e: f"JSON ({e.msg}: line {e.lineno} column {e.colno})"
    )


def read_jsonl(path: str | os.PathLike, what: str = "File") -> list[Any]:
    """The JSON values of a JSONL file's non-empty lines."""
    path = require_path(path, what, "check the path.")
    values = []
    for number, line in enumerate(_read_text(path, what).splitlines(), 1):
        if line.strip():
            try:
                values.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{number} is not valid JSON ({error.msg}: column {error.colno}); fix or delete that line."
                ) from None
    return values


def check_fields(cls: type, values: Mapping[str, Any], where: str) -> None:
    """Raises `ValueError` when `values` has keys that are not fields of the dataclass `cls` (suggesting the closest
    field names) or lacks a required one; `where` (e.g. "training config run.yaml") is named in the message."""
    names = [field.name for field in dataclasses.fields(cls)]
    unknown = [
        f"{key!r}" + "".join(f" (did you mean {match!r}?)" for match in get_close_matches(str(key), names, 1))
        for key in sorted(set(values) - set(names), key=str)
    ]
    if unknown:
        listed = "" if all("did you mean" in item for item in unknown) else f"; the fields are {', '.join(names)}"
        raise ValueError(f"Unknown field(s) in the {where}: {', '.join(unknown)}. Rename or remove them{listed}.")
    no_default = dataclasses.MISSING
    required = [f.name for f in dataclasses.fields(cls) if f.default is no_default and f.default_factory is no_default]
    missing = [name for name in required if name not in values]
    if missing:
        raise ValueError(f"The {where} lacks the required field(s) {', '.join(missing)}; add them.")


def check_types(cls: type, values: Mapping[str, Any], where: str) -> None:
    """Raises `ValueError` naming the field, the type it needs and the value found, for a value of `values` that does
    not fit the annotation of the dataclass `cls`'s field (integers, floats, strings, booleans, optional ones and
    unions of those are checked; containers and `Any` are left to the code that reads them)."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        expected = _simple_types(hints.get(name, Any))
        if expected is None or any(_fits(value, kind) for kind in expected):
            continue
        needs = " or ".join(_TYPE_NAMES.get(kind, getattr(kind, "__name__", str(kind))) for kind in expected)
        raise ValueError(f"The {where}: {name} must be {needs}, got {value!r}. Fix it in the file.")


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def _simple_types(hint: Any) -> tuple[type, ...] | None:
    """The plain types `hint` allows, or `None` when it allows something this check does not judge."""
    arguments = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if not all(kind in _TYPE_NAMES for kind in arguments):
        return None
    return arguments


def _fits(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)

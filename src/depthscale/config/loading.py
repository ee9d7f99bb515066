"""Loading a config: a TOML file, then dotted command-line overrides, each value checked against
the field's declared type; and writing one back as TOML (the run directory keeps it)."""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from depthscale.config.schema import Config
from depthscale.errors import ConfigError


def _section_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _describe(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


_BOOLS = {"1": True, "true": True, "yes": True, "on": True}
_BOOLS |= {"0": False, "false": False, "no": False, "off": False}


def _toml_repr(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def _coerce(key: str, value: Any, tp: Any, from_string: bool) -> Any:
    """Check (TOML) or parse (command line) one value against its declared type."""
    if get_origin(tp) is list:
        return _table_list(key, value, get_args(tp)[0], from_string)
    if get_origin(tp) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table {{name = value, ...}}, got {value!r}")
        item = get_args(tp)[1]
        return {str(k): _coerce(f"{key}.{k}", v, item, False) for k, v in value.items()}
    if get_origin(tp) is Literal:
        allowed = get_args(tp)
        if (
            any(a is True for a in allowed)
            and from_string
            and isinstance(value, str)
            and value.lower() in _BOOLS
        ):
            value = _BOOLS[value.lower()]  # a tri-state such as "auto" | true | false
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(
                f"{key}: {value!r} is not allowed; allowed: " + ", ".join(map(_toml_repr, allowed))
            )
        return value
    if get_origin(tp) in (typing.Union, types.UnionType):
        raise ConfigError(f"{key}: union types are not supported in the config schema")
    if tp is bool:
        if from_string and isinstance(value, str) and value.lower() in _BOOLS:
            return _BOOLS[value.lower()]
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a bool (true/false), got {value!r}")
    if tp is int:
        if from_string and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an int, got {value!r}")
    if tp is float:
        if from_string and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _table_list(key: str, value: Any, item: type, from_string: bool) -> list[Any]:
    """A list of tables (`[[eval.tasks]]` in TOML; on the command line an inline TOML array,
    `--eval.tasks '[{path = "a.jsonl"}]'`), every table's keys and values checked against `item`,
    each error naming `section.key[index].field`; a key the schema marks REQUIRED that a table
    leaves out is named as missing."""
    allowed = f"[[{key}]] tables, or on the command line --{key} '[{{key = value, ...}}, ...]'"
    if from_string and isinstance(value, str):
        try:
            value = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(
                f"{key}: {value!r} is not an inline TOML array ({err}); allowed: {allowed}"
            ) from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{key}: expected a list of tables, got {value!r}; allowed: {allowed}")
    hints = _section_types(item)
    out = []
    for i, table in enumerate(value):
        entry = item()
        for name, v in table.items():
            if name not in hints:
                raise _unknown(f"key in [[{key}]] (entry {i})", name, list(hints))
            setattr(entry, name, _coerce(f"{key}[{i}].{name}", v, hints[name], False))
        required = [f.name for f in dataclasses.fields(item) if f.metadata.get("required")]
        missing = [name for name in required if name not in table]
        if missing:  # not its default's value, which would read as if it were set
            raise ConfigError(
                f"{key}[{i}] misses {', '.join(missing)}; required in every [[{key}]] table: "
                + ", ".join(required)
            )
        out.append(entry)
    return out


def _unknown(kind: str, name: str, allowed: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(name, allowed, n=1)
    did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
    return ConfigError(f"unknown {kind} {name!r}{did_you_mean}; allowed: " + ", ".join(allowed))


def set_value(cfg: Config, dotted: str, value: Any, from_string: bool = False) -> None:
    """Set `section.key` on cfg after checking the key exists and the value has the right type."""
    parts = dotted.split(".")
    sections = [f.name for f in dataclasses.fields(Config)]
    if len(parts) != 2:
        raise ConfigError(
            f"config key {dotted!r} must look like 'section.key' "
            f"with section one of: {', '.join(sections)}"
        )
    section, key = parts
    if section not in sections:
        raise _unknown("config section", section, sections)
    sec = getattr(cfg, section)
    hints = _section_types(type(sec))
    if key not in hints:
        raise _unknown(f"key in [{section}]", key, list(hints))
    setattr(sec, key, _coerce(dotted, value, hints[key], from_string))


def from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    for section, values in data.items():
        if not isinstance(values, dict):
            sections = [f.name for f in dataclasses.fields(Config)]
            if section not in sections:
                raise _unknown("config section", section, sections)
            raise ConfigError(f"[{section}] must be a table of keys, got {values!r}")
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value)
    return cfg


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """Serialize a config as TOML (the run directory keeps one, so a run can be reproduced)."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        tables = {k: v for k, v in values.items() if isinstance(v, list)}
        for key, value in values.items():
            if key not in tables:
                lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
        for key, entries in tables.items():  # TOML: a table's keys before its sub-tables
            for entry in entries:
                lines.append(f"[[{section}.{key}]]")
                lines += [f"{k} = {toml_value(v)}" for k, v in entry.items()]
                lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """One config value as TOML writes it (bool, escaped string, number, inline table)."""
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return "{" + items + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _toml_key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    return key if bare else toml_value(key)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ['--model.dim', '128', '--train.compile=true'] into [('model.dim', '128'), ...]."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument {arg!r}; overrides look like --section.key VALUE"
            )
        arg = arg[2:]
        if "=" in arg:
            key, value = arg.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{arg} is missing its value")
            key, value = arg, args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML config file (or the defaults), apply `--section.key value` overrides, validate."""
    data = _read_toml(Path(path)) if path is not None else {}
    cfg = from_dict(data)
    for key, value in parse_overrides(overrides or []):
        set_value(cfg, key, value, from_string=True)
    return cfg.validate()


def _read_toml(path: Path) -> dict[str, Any]:
    """The TOML file's tables; anything else at `path` is named for what it is."""
    name = repr(str(path))
    if path.is_dir():
        inside = ", ".join(sorted(p.name for p in path.glob("*.toml"))[:5])
        raise ConfigError(
            f"config file {name} is a directory; allowed: a .toml file"
            + (f" (it holds {inside})" if inside else "")
        )
    if not path.exists():
        raise ConfigError(f"config file {name} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {name} is not a regular file; allowed: a .toml file")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {name} is not text ({err.reason} at byte {err.start}); "
            "allowed: a UTF-8 .toml file"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {name} is not valid TOML: {err}") from err

"""The command line as vLLM users type it, before argparse reads it: underscore spellings
(`--max_num_seqs 8`), the model as a positional argument (`stepserve serve ./model.gguf`), and
`--config FILE.yaml`, whose keys are flag names and whose values are what the command line
would hold. The file's values are read first and the command line's over them, so a flag
typed on the command line wins.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"
_NOT_IN_A_FILE = frozenset({"config", "help", "version"})


def parse_serve_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv` (after `stepserve serve`) with its config file's values under it."""
    argv = normalize_argv(parser, argv)
    config_path, argv = _take_config_flag(parser, argv)
    ns = argparse.Namespace()
    if config_path is not None:
        file_parser = copy.copy(parser)  # its errors name the file
        file_parser.prog = f"{parser.prog} {CONFIG_FLAG} {config_path}"
        ns = file_parser.parse_args(config_argv(parser, config_path))
    file_model, ns.model = getattr(ns, "model", None), None
    ns = parser.parse_args(argv, namespace=ns)
    if ns.model_tag is not None and ns.model is not None and not _same_path(
        ns.model_tag, ns.model
    ):
        parser.error(
            f"argument --model: {ns.model!r} and the positional model {ns.model_tag!r} differ; "
            "give one of them"
        )
    ns.model = ns.model_tag or ns.model or file_model
    ns.config = config_path
    return ns


def normalize_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--max_num_seqs` -> `--max-num-seqs` (also `--name=value`) for every flag `parser` has;
    anything after a bare `--` is left alone."""
    known = set(parser._option_string_actions)  # argparse has no public list of its flags
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        name, sep, value = arg.partition("=")
        dashed = "--" + name[2:].replace("_", "-")
        out.append(dashed + sep + value if name.startswith("--") and dashed in known else arg)
    return out


def config_argv(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The flags a YAML config file stands for; unknown keys and ill-typed values are errors
    that name the key (through `parser.error`: exit 2)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        parser.error(f"argument {CONFIG_FLAG}: cannot read {path}: {exc}")
    except yaml.MarkedYAMLError as exc:
        where = f" at line {exc.problem_mark.line + 1}" if exc.problem_mark else ""
        parser.error(f"argument {CONFIG_FLAG}: cannot read {path}: {exc.problem}{where}")
    except yaml.YAMLError as exc:
        parser.error(f"argument {CONFIG_FLAG}: cannot read {path}: {exc}")
    if data is None:
        return []
    if not isinstance(data, dict):
        parser.error(f"argument {CONFIG_FLAG}: {path}: expected a mapping of flag names to values")
    out: list[str] = []
    for key, value in data.items():
        try:
            out += _flag_tokens(parser, str(key), value)
        except ValueError as exc:
            parser.error(f"argument {CONFIG_FLAG}: {path}: {exc}")
    return out


def _flag_tokens(parser: argparse.ArgumentParser, key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    action = parser._option_string_actions.get(flag)
    if action is None or flag[2:] in _NOT_IN_A_FILE:
        raise ValueError(f"unknown key {key!r} (keys are the flags' names, e.g. max_num_seqs)")
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ValueError(f"key {key!r} is a switch: give true or false, got {value!r}")
        if value:
            return [flag]
        if isinstance(action, argparse.BooleanOptionalAction):
            other = [s for s in action.option_strings if s != flag]
            return other[:1]
        return []
    many = action.nargs not in (None, "?")
    items = value if isinstance(value, list) and many else [value]
    for item in items:
        if isinstance(item, bool | dict | list) or item is None:
            what = "a list" if many else "one value"
            raise ValueError(f"key {key!r} takes {what} as on the command line, got {value!r}")
    return [flag, *(str(item) for item in items)]


def _take_config_flag(
    parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[Path | None, list[str]]:
    """Remove every `--config FILE` / `--config=FILE` from argv (the last one counts, as for
    any flag); the file must exist."""
    value: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg == CONFIG_FLAG:
            if i + 1 >= len(argv):
                parser.error(f"argument {CONFIG_FLAG}: expected one argument")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(CONFIG_FLAG + "="):
            value = arg.partition("=")[2]
        else:
            rest.append(arg)
        i += 1
    if value is None:
        return None, rest
    path = Path(value).expanduser()
    if not path.is_file():
        parser.error(f"argument {CONFIG_FLAG}: no such file: {value!r}")
    return path, rest


def _same_path(a: str, b: str) -> bool:
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()

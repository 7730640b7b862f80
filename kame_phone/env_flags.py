"""Command-line flags whose default comes from an environment variable.

Deployments (compose, Kubernetes) set the environment, not the command line, so every flag a deployment
needs has a variable: the flag wins when given, else the variable when set, else the built-in default.
A variable is read after parsing, so only the chosen command's variables are checked; a value that does
not parse is refused in one line naming the variable (`EnvError`), never silently replaced by the default.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """An environment variable holds a value its flag would refuse."""


def parse_bool(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"not a boolean (use one of {', '.join(_TRUE + _FALSE)})")


def parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("not an integer") from None


def parse_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value):  # float() takes "nan" and "inf": a timeout of nan never fires
        raise ValueError("not a finite number")
    return value


def within(low: float, high: float = math.inf, parse: Callable[[str], Any] = parse_int) -> Callable[[str], Any]:
    """`parse`, then refused outside [low, high]: a count of 0 call slots or a negative timeout parsed fine and
    failed later, with a traceback from the engine's child or every call cut at SIGTERM."""
    def parsed(raw: str) -> Any:
        value = parse(raw)
        if not low <= value <= high:
            raise ValueError(f"must be {low:g} or more" if high == math.inf else f"must be {low:g} to {high:g}")
        return value

    # argparse names the type in its refusal of a flag's value: "invalid integer >= 1 value: '0'".
    kind = "integer" if parse is parse_int else "number"
    parsed.__name__ = f"{kind} >= {low:g}" if high == math.inf else f"{kind} in {low:g}..{high:g}"
    return parsed


@dataclass(frozen=True)
class EnvDefault:
    """A flag's default, standing in the parsed namespace until `resolve_env_defaults` reads `env`."""

    env: str
    default: Any
    parse: Callable[[str], Any] = str
    choices: Sequence[str] | None = None

    def resolve(self) -> Any:
        raw = os.environ.get(self.env, "")
        if raw == "":
            return self.default
        try:
            value = self.parse(raw)
        except ValueError as e:
            raise EnvError(f"{self.env}={raw!r} is refused: {e}") from None
        if self.choices is not None and value not in self.choices:
            raise EnvError(f"{self.env}={raw!r} is refused: choose from {', '.join(self.choices)}")
        return value


def env_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    env: str,
    *,
    default: Any = None,
    parse: Callable[[str], Any] = str,
    choices: Sequence[str] | None = None,
    switch: bool = False,
    help: str = "",  # noqa: A002 - argparse's own name for it
) -> None:
    """`parser.add_argument(flag, ...)` with its default from $env. `switch`: an on/off flag (the variable
    takes 1/0, true/false, yes/no, on/off); one that is on by default also gets its --no- form."""
    text = f"{help} (env {env})" if help else f"env {env}"
    if switch:
        action = argparse.BooleanOptionalAction if default else "store_true"
        parser.add_argument(flag, action=action, default=EnvDefault(env, bool(default), parse_bool), help=text)
        return
    # `type` parses the flag's own value; a non-string default is left alone by argparse (the EnvDefault).
    parser.add_argument(flag, type=parse, choices=choices, default=EnvDefault(env, default, parse, choices), help=text)


def resolve_env_defaults(args: argparse.Namespace) -> None:
    """Replace every flag left at its `EnvDefault` by the variable's value or the default; raises EnvError."""
    for name, value in vars(args).items():
        if isinstance(value, EnvDefault):
            setattr(args, name, value.resolve())

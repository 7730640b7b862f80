"""The engine's storage and compile settings: each flag has its variable, the flag wins, and a variable that
does not parse stops start-up naming it."""

from __future__ import annotations

import pytest

from engine.service import EngineConfig
from kame_phone.app import engine_config_from_args
from kame_phone.cli import build_parser
from kame_phone.env_flags import EnvError, resolve_env_defaults


def _serve_config(*argv: str) -> EngineConfig:
    args = build_parser().parse_args(["serve", *argv])
    resolve_env_defaults(args)
    return engine_config_from_args(args)


@pytest.mark.parametrize(
    ("flag", "variable", "field", "default", "values", "bad"),
    [
        ("--kv-dtype", "KAME_KV_DTYPE", "kv_dtype", "auto", ("int8", "fp8"), "int4"),
        ("--weights-dtype", "KAME_WEIGHTS_DTYPE", "weights_dtype", "auto", ("int8",), "int4"),
        ("--compile", "KAME_COMPILE", "compile_mode", "off", ("default", "max-autotune"), "yes"),
    ],
)
def test_a_flag_its_variable_and_a_bad_value(
    monkeypatch: pytest.MonkeyPatch, flag: str, variable: str, field: str, default: str, values: tuple[str, ...],
    bad: str,
) -> None:
    monkeypatch.delenv(variable, raising=False)
    assert getattr(_serve_config(), field) == default
    for value in values:
        assert getattr(_serve_config(flag, value), field) == value
        monkeypatch.setenv(variable, value)
        assert getattr(_serve_config(), field) == value
        assert getattr(_serve_config(flag, default), field) == default  # the flag wins
    monkeypatch.setenv(variable, bad)
    with pytest.raises(EnvError, match=variable):
        _serve_config()
    monkeypatch.delenv(variable)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, bad])

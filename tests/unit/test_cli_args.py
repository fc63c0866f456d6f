"""`imgret ingest PATH --ray [ADDRESS]`: the optional value is filled in before Typer parses."""

from __future__ import annotations

import pytest

from imgret.cli.main import complete_optional_values


@pytest.mark.parametrize(("args", "expected"), [
    (["ingest", "d", "--ray"], ["ingest", "d", "--ray", "local"]),
    (["ingest", "d", "--ray", "--model", "m"], ["ingest", "d", "--ray", "local", "--model", "m"]),
    (["ingest", "d", "--ray", "auto"], ["ingest", "d", "--ray", "auto"]),
    (["d", "--ray", "ray://h:10001", "-q"], ["d", "--ray", "ray://h:10001", "-q"]),
    (["ingest", "d"], ["ingest", "d"]),
])
def test_ray_address_is_optional(args, expected):
    assert complete_optional_values(args) == expected


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("IMGRET_RUNTIME", "bogus", "IMGRET_RUNTIME: Input should be 'auto', 'torch' or "
                                "'onnxruntime'"),
    ("IMGRET_DEVICE", "tpu", "IMGRET_DEVICE: Input should be 'auto', 'cpu' or 'cuda'"),
])
def test_a_bad_setting_is_one_line_and_exit_code_2(name, value, expected, monkeypatch,
                                                   capsys) -> None:
    from imgret.cli.main import main
    from imgret.settings import get_settings

    monkeypatch.setenv(name, value)
    monkeypatch.setattr("sys.argv", ["imgret", "models", "list"])
    get_settings.cache_clear()
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:
        get_settings.cache_clear()
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {expected}"
    assert value not in err  # the value is not echoed

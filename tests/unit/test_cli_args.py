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

"""Schema fuzzing: schemathesis against a real server's ``/openapi.json`` on PostgreSQL.

For every operation of the schema, schemathesis generates requests that follow the schema
(positive) and requests that break it (negative: wrong types, out-of-range values, missing
fields), sends them to a real ``imgret serve`` (with an API key, which every request carries,
so that writes reach their handlers) and checks each response:

* ``not_a_server_error``: no 5xx;
* ``status_code_conformance``: the status is one the schema documents for the operation;
* ``content_type_conformance``: the content type is one the schema documents;
* ``response_schema_conformance``: the body validates against the documented schema.

The model and admin surface is fuzzed like the rest, and seeded so that it is reached:
upload fields get real checkpoints (whole, truncated, and with bytes flipped) as well as
images and noise; a ``{version}`` in the path is a registered version half of the time
(the served one, or a second one registered before fuzzing), so ``embed``, ``activate`` and
``GET /models/{version}`` run on real versions, not only on 404s. The test checks that every
``/models`` and ``/admin`` operation ran.

Bounded: ``IMGRET_FUZZ_EXAMPLES`` examples per operation and mode (default 30, about a
minute of the suite's time on 2 cores; ``IMGRET_FUZZ_EXAMPLES=300`` for a deeper search;
``/admin`` operations at most 10: each backup copies the database and the media), no shrinking,
no example database; every failure is collected and reported together. ``pytest -s`` prints
the number of cases run per operation.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from tests.conftest import TEST_DEVICE
from tests.support.images import class_image, image_bytes
from tests.support.live_server import running_server

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

EXAMPLES = int(os.environ.get("IMGRET_FUZZ_EXAMPLES", "30"))
ADMIN_EXAMPLES = min(EXAMPLES, 10)
# The surface the fuzzing must reach (asserted): model versions and administration.
MODEL_AND_ADMIN = ("/models", "/admin")
KEY = "fuzz-key"
DETAILS: dict[str, Counter[str]] = {}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def _image_samples() -> list[bytes]:
    """Real images of several formats and sizes: most random bytes are not an image, and
    requests that never decode one would not reach the embedding, the index or SQL."""
    images = [image_bytes(class_image(c, i)) for c in range(3) for i in range(3)]
    images += [image_bytes(class_image(3, 0), "JPEG"), image_bytes(class_image(4, 0), "GIF"),
               image_bytes(class_image(5, 0, size=1)), image_bytes(class_image(6, 0, size=97))]
    return images


def _checkpoint_bytes(seed: int) -> bytes:
    """A real tiny checkpoint (``model.pt``) whose weights depend on ``seed``."""
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16,
                                                       image_size=32)))
        return (Path(folder) / "model.pt").read_bytes()


def _checkpoint_samples() -> list[bytes]:
    """Checkpoints a client may upload: a real one, a truncated one, one with bytes flipped
    in the middle of its zip (a CRC error when read)."""
    whole = _checkpoint_bytes(2)
    flipped = bytearray(whole)
    middle = len(flipped) // 2
    flipped[middle:middle + 16] = bytes(b ^ 0xFF for b in flipped[middle:middle + 16])
    return [whole, whole[: len(whole) // 2], bytes(flipped)]


@pytest.fixture
def binary_fields_hold_images() -> Iterator[None]:
    """``format: binary`` fields (uploads) get a real image or checkpoint most of the time."""
    from schemathesis.specs.openapi import formats

    saved = formats.STRING_FORMATS.get("binary")
    schemathesis.openapi.format(
        "binary", st.one_of(st.sampled_from(_image_samples()),
                            st.sampled_from(_checkpoint_samples()), st.binary(max_size=300))
    )
    yield
    if saved is None:
        formats.unregister_string_format("binary")
    else:
        formats.STRING_FORMATS["binary"] = saved
        formats._invalidate_caches()


def _seed(base: str) -> None:
    files = [("images", (f"{i}.png", image_bytes(class_image(i % 3, i)), "image/png"))
             for i in range(6)]
    response = httpx.post(f"{base}/gallery", files=files, headers={"X-API-Key": KEY},
                          data={"labels": [str(i % 3) for i in range(6)]}, timeout=60)
    assert response.status_code == 201, response.text


def _register_second_version(base: str) -> str:
    response = httpx.post(f"{base}/models", headers={"X-API-Key": KEY}, timeout=60,
                          files={"checkpoint": ("model.pt", _checkpoint_bytes(1))})
    assert response.status_code == 201, response.text
    return response.json()["version"]


def _drawable(strategy):
    """``strategy`` without the cases schemathesis cannot build: its negative mode validates
    a mutated multipart body with the file still in it, and its validator raises "Unsupported
    type: 'Binary'" for the file (a generator limit, not a server answer): that draw is
    dropped and another one made."""

    @st.composite
    def cases(draw):
        try:
            return draw(strategy)
        except ValueError as exc:
            if "Unsupported type: 'Binary'" not in str(exc):
                raise
            reject()

    return cases()


def _strategy(operation, mode: GenerationMode, versions: list[str]):
    """The operation's cases; a ``{version}`` path parameter is a registered version half of
    the time (generated strings are 404s)."""
    strategy = _drawable(operation.as_strategy(generation_mode=mode))
    if "{version}" not in operation.path:
        return strategy

    def with_version(pair):
        case, version = pair
        if version is not None:
            case.path_parameters = {**(case.path_parameters or {}), "version": version}
        return case

    return st.tuples(strategy, st.sampled_from([*versions, None, None])).map(with_version)


def _fuzz(operation, mode: GenerationMode, base: str, cases: Counter[str],
          statuses: dict[str, Counter[int]], failures: dict[str, str],
          versions: list[str]) -> None:
    """Run ``EXAMPLES`` generated requests of one operation; count them, collect failures."""
    label = f"{operation.label} [{mode.value}]"
    examples = ADMIN_EXAMPLES if operation.path.startswith("/admin") else EXAMPLES

    @settings(max_examples=examples, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=_strategy(operation, mode, versions))
    def fuzz(case) -> None:
        cases[label] += 1
        response = case.call(base_url=base, headers={"X-API-Key": KEY}, timeout=60)
        statuses.setdefault(label, Counter())[response.status_code] += 1
        if response.status_code == 422:
            DETAILS.setdefault(label, Counter())[response.text[:120]] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup
            failures.setdefault(f"{label} -> {response.status_code}", str(exc)[:1500])

    # Unsatisfiable: nothing to break (GET /health has no parameters), no negative case exists.
    with contextlib.suppress(Unsatisfiable):
        fuzz()


def _explicit(operation, base: str, cases: Counter[str], statuses: dict[str, Counter[int]],
              failures: dict[str, str]) -> None:
    """Cases generation rarely builds whole: each checkpoint sample uploaded alone (one of
    them registers), and a backup under a name that exists."""
    label = f"{operation.label} [explicit]"
    if operation.label == "POST /models":
        made = [operation.Case(body={"checkpoint": data}, media_type="multipart/form-data")
                for data in _checkpoint_samples()]
    elif operation.label == "POST /admin/backup":
        made = [operation.Case(body={"name": "fuzz-twice"}, media_type="application/json")] * 2
    else:
        return
    for case in made:
        cases[label] += 1
        response = case.call(base_url=base, headers={"X-API-Key": KEY}, timeout=60)
        statuses.setdefault(label, Counter())[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, BaseExceptionGroup) as exc:
            failures.setdefault(f"{label} -> {response.status_code}", str(exc)[:1500])


def test_schema_fuzzing_finds_no_server_errors_and_no_schema_violations(
    tmp_path: Path, postgres_url: str, tiny_checkpoint: Path, binary_fields_hold_images: None
) -> None:
    env = {
        "IMGRET_DATA_DIR": str(tmp_path / "data"),
        "IMGRET_DATABASE_URL": postgres_url,
        "IMGRET_MODEL": str(tiny_checkpoint),
        "IMGRET_DEVICE": TEST_DEVICE,
        "IMGRET_API_KEY": KEY,
        "IMGRET_MAX_UPLOAD_BYTES": "1000000",
        "IMGRET_BATCH_MAX_WAIT_MS": "1",
    }
    with running_server(env, log_path=tmp_path / "server.log") as server:
        base = server.url
        _seed(base)
        versions = [httpx.get(f"{base}/health").json()["model_version"],
                    _register_second_version(base)]
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        cases: Counter[str] = Counter()
        statuses: dict[str, Counter[int]] = {}
        failures: dict[str, str] = {}
        started = time.monotonic()
        operations = [result.ok() for result in schema.get_all_operations()]
        for operation in operations:
            _explicit(operation, base, cases, statuses, failures)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz(operation, mode, base, cases, statuses, failures, versions)
        elapsed = time.monotonic() - started
        assert server.process.poll() is None, "the server died"
        assert httpx.get(f"{base}/health").status_code == 200

    total = sum(cases.values())
    print(f"\n[schema fuzz, PostgreSQL] {total} cases over {len(cases)} operation/mode pairs in "
          f"{elapsed:.0f} s; {len(failures)} distinct failures")
    for label, count in sorted(cases.items()):
        print(f"  {count:4d}  {label:40s} {dict(sorted(statuses[label].items()))}")
        for text, n in DETAILS.get(label, Counter()).most_common(4):
            print(f"          {n} x {text}")
    assert total >= 10 * len(cases) // 2, "schemathesis generated too few cases"
    surface = [op.label for op in operations if op.path.startswith(MODEL_AND_ADMIN)]
    assert len(surface) >= 7, surface  # list, read, register, rollback, embed, activate, backup
    for label in surface:
        assert cases[f"{label} [positive]"] >= 1, f"{label} was not fuzzed"
    assert 201 in statuses["POST /models [explicit]"], "no checkpoint upload registered"
    assert statuses["POST /admin/backup [explicit]"] == Counter({201: 1, 409: 1})
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())

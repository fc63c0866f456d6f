"""Schema fuzzing (issue 10): schemathesis against a real server's ``/openapi.json`` on PostgreSQL.

For every operation of the schema, schemathesis generates requests that follow the schema
(positive) and requests that break it (negative: wrong types, out-of-range values, missing
fields), sends them to a real ``imgret serve`` (with an API key, which every request carries,
so that writes reach their handlers) and checks each response:

* ``not_a_server_error``: no 5xx;
* ``status_code_conformance``: the status is one the schema documents for the operation;
* ``content_type_conformance``: the content type is one the schema documents;
* ``response_schema_conformance``: the body validates against the documented schema.

Bounded: ``IMGRET_FUZZ_EXAMPLES`` examples per operation and mode (default 50), no shrinking,
no example database; every failure is collected and reported together. ``pytest -s`` prints
the number of cases run per operation.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from benchmarks.harness import running_server
from tests.conftest import TEST_DEVICE
from tests.support.images import class_image, image_bytes

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

EXAMPLES = int(os.environ.get("IMGRET_FUZZ_EXAMPLES", "50"))
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


@pytest.fixture
def binary_fields_hold_images() -> Iterator[None]:
    """``format: binary`` fields (uploads) get a real image half of the time."""
    from schemathesis.specs.openapi import formats

    saved = formats.STRING_FORMATS.get("binary")
    schemathesis.openapi.format(
        "binary", st.one_of(st.sampled_from(_image_samples()), st.binary(max_size=300))
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


def _fuzz(operation, mode: GenerationMode, base: str, cases: Counter[str],
          statuses: dict[str, Counter[int]], failures: dict[str, str]) -> None:
    """Run ``EXAMPLES`` generated requests of one operation; count them, collect failures."""
    label = f"{operation.label} [{mode.value}]"

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
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
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        cases: Counter[str] = Counter()
        statuses: dict[str, Counter[int]] = {}
        failures: dict[str, str] = {}
        started = time.monotonic()
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz(operation, mode, base, cases, statuses, failures)
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
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())

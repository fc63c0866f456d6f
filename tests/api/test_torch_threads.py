"""Torch runs on the model thread alone once serving: start-up, gallery uploads and
evaluations run their torch work on threads that end, and leave no OpenMP workers behind
(imgret.process.in_own_thread says why that matters). Served by torch: ONNX Runtime's session
keeps its own intra-op pool for as long as the version is loaded, by design."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import imgret.gallery.versions.intake
import imgret.service.app
import imgret.service.gallery
import imgret.service.version_evaluation
from imgret.metrics import retrieval_metrics
from imgret.process import in_own_thread
from tests.api.conftest import add_gallery, png
from tests.support.threads import (
    native_threads_settle_at,
    parallel_torch_op,
    steady_native_threads,
    torch_threads,
)


def _parallel_torch_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, first running a parallel torch operator on the thread that calls it, as
    loading or running a real model on 2 cores does (the tests' tiny model is too small to
    start OpenMP workers)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        parallel_torch_op()
        return fn(*args, **kwargs)

    return run


def test_torch_work_off_the_model_thread_leaves_no_threads_behind(
    make_local_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module, name in [(imgret.service.app, "load_resources"),
                         (imgret.service.gallery, "add_items"),
                         (imgret.service.version_evaluation, "evaluate_uploaded"),
                         (imgret.gallery.versions.intake, "load_embedder")]:
        monkeypatch.setattr(module, name, _parallel_torch_first(getattr(module, name)))
    with torch_threads(2):
        # The BLAS libraries start one pool of threads per process, the first time they are
        # used (scipy's by the evaluation's confidence intervals): started here, before
        # counting.
        in_own_thread(retrieval_metrics, np.eye(4, dtype=np.float32), np.arange(4) % 2,
                      np.eye(4, dtype=np.float32), np.arange(4) % 2, k=1, bootstrap=10)
        before = steady_native_threads()
        with make_local_client(runtime="torch") as client:
            assert native_threads_settle_at(before), "start-up"
            add_gallery(client, classes=2, per_class=2)
            assert native_threads_settle_at(before), "POST /gallery"
            response = client.post("/evaluate", data={"labels": ["0", "1"]}, files=[
                ("images", (f"q{c}.png", png(c, 9), "image/png")) for c in (0, 1)])
            assert response.status_code == 200, response.text
            assert native_threads_settle_at(before), "POST /evaluate"
            version = client.get("/health").json()["model_version"]
            client.app.state.resources.embedders.clear()  # loaded again, as on a switch
            client.app.state.resources.embedder_for(version)
            assert native_threads_settle_at(before), "a model loaded for a version"

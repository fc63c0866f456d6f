"""limit_pthreads_blas: NumPy's own BLAS pool goes to the asked thread count, FAISS's OpenMP
BLAS (which follows FAISS's OpenMP count) is left alone."""

from __future__ import annotations

import numpy as np
import pytest

from imgret.gallery.search.threads import limit_pthreads_blas

threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas() -> dict[str, int]:
    return {lib.filepath: lib.num_threads for lib in threadpoolctl.ThreadpoolController()
            .lib_controllers if lib.user_api == "blas"}


def test_numpy_blas_goes_to_one_thread_and_faiss_blas_is_left_alone() -> None:
    np.ones((2, 2)) @ np.ones((2, 2))  # NumPy's BLAS is loaded
    controller = threadpoolctl.ThreadpoolController()
    pthreads = [lib for lib in controller.lib_controllers
                if lib.user_api == "blas" and getattr(lib, "threading_layer", "") == "pthreads"]
    before = _blas()
    try:
        limited = limit_pthreads_blas(1)
        after = _blas()
        assert limited == len(pthreads)
        for lib in controller.lib_controllers:
            if lib.user_api != "blas":
                continue
            if lib in pthreads:
                assert after[lib.filepath] == 1
            else:
                assert after[lib.filepath] == before[lib.filepath]
    finally:
        for lib in pthreads:
            lib.set_num_threads(before[lib.filepath])

"""Data-parallel training: `torchrun --nproc_per_node=2 -m imgret.cli train` on CPU (gloo)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from imgret.cli.train import NOT_LEARNED_EXIT
from tests.support.images import write_image_folder

ROOT = Path(__file__).resolve().parents[2]
CHECKSUM = re.compile(r"DDP rank (\d) final parameter checksum (\S+) loss (\S+)")


@pytest.mark.slow
def test_two_process_ddp_run_on_cpu(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    data = write_image_folder(tmp_path / "data", classes=12, per_class=8)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(
        [*command, "--standalone", "--nproc_per_node=2", "-m", "imgret.cli", "train",
         "--data", str(data), "--out", str(out), "--loss", "proxy_anchor",
         "--backbone", "tiny_cnn", "--dim", "16", "--image-size", "32", "--epochs", "1",
         "--batch-size", "8", "--device", "cpu", "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    log = result.stdout + result.stderr
    # The untrained network already ranks these colour classes well, so the run may not beat
    # it (rank 0 exits 3, which torchrun reports as its failure; no model): this test is
    # about the two processes, not about learning.
    learned = result.returncode == 0
    assert learned or f"exitcode: {NOT_LEARNED_EXIT}" in log, log[-4000:]
    assert (out / "model.pt").is_file() == learned
    assert (out / "metrics.json").is_file()

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished"
    assert metrics["world_size"] == 2
    # 12 classes split 4 train / 2 validation / 6 test (the class-disjoint proportions):
    # 4 training classes x 8 images = 4 batches of 8, shared by 2 ranks: 2 steps each.
    assert metrics["steps_per_epoch"] == 2
    last = metrics["epochs"][-1]
    assert last["epoch"] == 1 and math.isfinite(last["train_loss"])
    assert result.stdout.count("test MAP@R") == 1  # rank 0 alone reports

    # DDP kept the replicas in step: network and loss proxies end equal on both ranks.
    sums = {int(rank): (float(net), float(loss)) for rank, net, loss in CHECKSUM.findall(log)}
    assert set(sums) == {0, 1}, log[-4000:]
    assert sums[0] == sums[1]

"""Hostile checkpoints: each malformed file is a CheckpointError that names the problem and
quotes nothing of the file; the budgets hold before anything large is allocated (a deflate
bomb, a huge ``dim``), measured in a subprocess; a good checkpoint still loads."""

from __future__ import annotations

import copy
import io
import json
import pickle
import secrets
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from imgret.backbones import BACKBONES
from imgret.checkpoint import (
    FORMAT,
    MAX_ARCHIVE_ENTRIES,
    MAX_PICKLE_BYTES,
    EmbeddingNet,
    ModelSpec,
    content_digest,
    expected_state,
    load_checkpoint,
    save_checkpoint,
    version_name,
)
from imgret.errors import CheckpointError
from tests.support.threads import run_in_threads

# Planted in every hostile file (as a value, a key, a name, raw bytes): no message may carry
# any 6-character piece of it.
SECRET = "Qzv" + secrets.token_hex(12)
SPEC = ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)
MIB = 1 << 20
BOMB_TENSOR_BYTES = 200 * MIB


def leaked(message: str) -> list[str]:
    return [SECRET[i:i + 6] for i in range(len(SECRET) - 5) if SECRET[i:i + 6] in message]


@pytest.fixture(scope="module")
def good_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("good") / "model.pt"
    save_checkpoint(path, EmbeddingNet(SPEC), extra={"note": SECRET})
    return path


@pytest.fixture(scope="module")
def good_payload(good_path: Path) -> dict[str, Any]:
    return torch.load(good_path, weights_only=True)


def saved(payload: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def rezipped(data: bytes, compression: int = zipfile.ZIP_STORED,
             pad_entries: int = 0) -> bytes:
    """The same archive written again with ``compression``, plus empty padding entries."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=compression)
        prefix = src.infolist()[0].filename.split("/")[0]
        for n in range(pad_entries):
            dst.writestr(f"{prefix}/pad/{n}", b"")
    return out.getvalue()


def pickle_overwritten(data: bytes) -> bytes:
    """The archive with its pickle's bytes replaced by the secret (the directory intact)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    raw = bytearray(data)
    start = data.index(b"\x80\x02", info.header_offset)  # the pickle's protocol header
    junk = (SECRET.encode() * (info.file_size // len(SECRET) + 1))[:info.file_size]
    raw[start:start + info.file_size] = junk
    return bytes(raw)


class Planted:
    """A class the weights-only unpickler refuses."""

    def __init__(self) -> None:
        self.secret = SECRET


DROP = object()


def payload_with(**changes: Any) -> Callable[[dict], bytes]:
    def build(payload: dict) -> bytes:
        payload = copy.deepcopy(payload)
        for key, value in changes.items():
            if value is DROP:
                del payload[key]
            else:
                payload[key] = value
        return saved(payload)

    return build


def spec_with(**changes: Any) -> Callable[[dict], bytes]:
    def build(payload: dict) -> bytes:
        return saved({**payload, "spec": {**payload["spec"], **changes}})

    return build


def state_with(change: Callable[[dict], None]) -> Callable[[dict], bytes]:
    def build(payload: dict) -> bytes:
        state = dict(payload["state_dict"])
        change(state)
        return saved({**payload, "state_dict": state})

    return build


def _set(name: str, value: Any) -> Callable[[dict], None]:
    return lambda state: state.__setitem__(name, value)


def _rename(state: dict) -> None:
    state[SECRET] = state.pop("head.weight")


def _scaled(name: str, factor: float) -> Callable[[dict], None]:
    return lambda state: state.__setitem__(name, state[name] * factor)


# (id, builder from the good payload and bytes, regex the message must match)
CASES: list[tuple[str, Callable[[dict, bytes], bytes], str]] = [
    ("not-a-zip", lambda p, b: (SECRET * 100).encode(), "not a zip archive"),
    ("empty", lambda p, b: b"", "not a zip archive"),
    ("plain-pickle", lambda p, b: pickle.dumps({"format": FORMAT, "note": SECRET}),
     "not a zip archive"),
    ("torch-legacy-format", lambda p, b: _legacy(p), "not a zip archive"),
    ("truncated", lambda p, b: b[:len(b) // 2], "not a zip archive"),
    ("start-cut-off", lambda p, b: b[-2000:], "cannot read checkpoint"),
    ("pickle-overwritten", lambda p, b: pickle_overwritten(b), "cannot read checkpoint"),
    ("zip-of-text", lambda p, b: _zip_of_text(), "cannot read checkpoint"),
    ("forbidden-global", lambda p, b: saved({**p, "extra": {"x": Planted()}}),
     "cannot read checkpoint"),
    ("compressed-entry", lambda p, b: rezipped(b, zipfile.ZIP_DEFLATED),
     "compressed entries"),
    ("too-many-entries", lambda p, b: rezipped(b, pad_entries=MAX_ARCHIVE_ENTRIES),
     "too many archive entries"),
    ("directory-too-big", lambda p, b: _long_names(b), "the archive directory is 1.1 MiB"),
    ("pickle-too-big",
     lambda p, b: saved({**p, "extra": {"note": SECRET * (MAX_PICKLE_BYTES // len(SECRET))}}),
     r"data\.pkl\) is 4\.0 MiB, over the budget"),
    ("not-a-dict", lambda p, b: saved([SECRET]), "holds a list, not a dict"),
    ("tensor-not-a-dict", lambda p, b: saved(torch.zeros(3)), "holds a Tensor, not a dict"),
    ("format-missing", lambda p, b: payload_with(format=DROP)(p), "not an imgret checkpoint"),
    ("format-wrong", lambda p, b: payload_with(format=SECRET)(p), "not an imgret checkpoint"),
    ("unknown-top-level-key", lambda p, b: saved({**p, SECRET: 1}), "unknown top-level keys"),
    ("spec-missing", lambda p, b: payload_with(spec=DROP)(p), "no spec"),
    ("spec-list", lambda p, b: payload_with(spec=[SECRET])(p), "spec should be a dict, not list"),
    ("spec-unknown-field", lambda p, b: spec_with(**{SECRET: 1})(p),
     "spec has an unknown field"),
    ("spec-bytes-key", lambda p, b: saved({**p, "spec": {**p["spec"], SECRET.encode(): 1}}),
     "spec has a key that is not a field name"),
    ("backbone-unknown", lambda p, b: spec_with(backbone=SECRET)(p),
     "spec.backbone: must be one of .*tiny_cnn"),
    ("backbone-not-a-string", lambda p, b: spec_with(backbone=[SECRET])(p),
     "spec.backbone: Input should be a valid string"),
    ("dim-negative", lambda p, b: spec_with(dim=-1)(p),
     "spec.dim: Input should be greater than or equal to 1"),
    ("dim-zero", lambda p, b: spec_with(dim=0)(p), "spec.dim: .*greater than or equal to 1"),
    ("dim-2^40", lambda p, b: spec_with(dim=2**40)(p),
     "spec.dim: Input should be less than or equal to 4096"),
    ("dim-5e6", lambda p, b: spec_with(backbone="resnet18", dim=5_000_000, image_size=224)(p),
     "spec.dim: .*less than or equal to 4096"),
    ("dim-text", lambda p, b: spec_with(dim=SECRET)(p), "spec.dim: Input should be a valid "
                                                         "integer"),
    ("image-size-zero", lambda p, b: spec_with(image_size=0)(p),
     "spec.image_size: Input should be greater than or equal to 8"),
    ("image-size-huge", lambda p, b: spec_with(image_size=10**6)(p),
     "spec.image_size: Input should be less than or equal to 512"),
    ("mean-nan", lambda p, b: spec_with(mean=(0.5, float("nan"), 0.5))(p),
     "spec.mean.1: Input should be a finite number"),
    ("mean-short", lambda p, b: spec_with(mean=(0.5, 0.5))(p), "spec.mean.2: Field required"),
    ("std-zero", lambda p, b: spec_with(std=(0.2, 0.2, 0.0))(p),
     "spec.std.2: Input should be greater than 0"),
    ("std-negative", lambda p, b: spec_with(std=(-0.2, 0.2, 0.2))(p),
     "spec.std.0: Input should be greater than 0"),
    ("std-inf", lambda p, b: spec_with(std=(0.2, float("inf"), 0.2))(p),
     "spec.std.1: Input should be a finite number"),
    ("vit-patch-misfit", lambda p, b: spec_with(backbone="vit_b_16", image_size=33)(p),
     "the vit_b_16 backbone cannot be built at image_size 33"),
    ("model-over-budget",
     lambda p, b: spec_with(backbone="small_cnn", dim=4096, image_size=512)(p),
     r"the model the spec describes \(small_cnn, dim 4096, image_size 512\) is 8192\.\d "
     "MiB, over the budget"),
    ("state-dict-missing", lambda p, b: payload_with(state_dict=DROP)(p), "no state_dict"),
    ("state-dict-list", lambda p, b: payload_with(state_dict=list(p["state_dict"].values()))(p),
     "state_dict should be a dict, not list"),
    ("tensor-missing", lambda p, b: state_with(lambda s: s.pop("head.bias"))(p),
     r"1 missing tensors \(head.bias\), 0 unexpected"),
    ("tensor-extra", lambda p, b: state_with(_set(SECRET, torch.zeros(2)))(p),
     "0 missing tensors, 1 unexpected"),
    ("tensor-renamed", lambda p, b: state_with(_rename)(p),
     r"1 missing tensors \(head.weight\), 1 unexpected"),
    ("tensor-key-not-a-string", lambda p, b: state_with(_set(7, torch.zeros(2)))(p),
     "0 missing tensors, 1 unexpected"),
    ("value-not-a-tensor", lambda p, b: state_with(_set("head.weight", SECRET))(p),
     "state_dict.head.weight is not a dense CPU tensor"),
    ("value-sparse", lambda p, b: state_with(
        _set("head.weight", p["state_dict"]["head.weight"].to_sparse()))(p),
     "state_dict.head.weight is not a dense CPU tensor"),
    ("value-meta", lambda p, b: state_with(
        _set("head.weight", torch.empty(16, 32, device="meta")))(p),
     "state_dict.head.weight is not a dense CPU tensor"),
    ("shape-wrong", lambda p, b: state_with(_set("head.weight", torch.zeros(5, 32)))(p),
     r"state_dict.head.weight has shape \(5, 32\), the config needs \(16, 32\)"),
    ("dtype-integer", lambda p, b: state_with(
        _set("head.weight", torch.zeros(16, 32, dtype=torch.int32)))(p),
     "state_dict.head.weight is torch.int32, not a floating-point tensor"),
    ("dtype-complex", lambda p, b: state_with(
        _set("head.bias", torch.zeros(16, dtype=torch.complex64)))(p),
     "state_dict.head.bias is torch.complex64, not a floating-point tensor"),
    ("counter-float", lambda p, b: state_with(
        _set("trunk.1.num_batches_tracked", torch.tensor(1.0)))(p),
     "state_dict.trunk.1.num_batches_tracked is torch.float32, the config needs torch.int64"),
    ("weights-nan", lambda p, b: state_with(_scaled("head.bias", float("nan")))(p),
     "state_dict.head.bias holds NaN or infinite values"),
    ("weights-inf", lambda p, b: state_with(_scaled("head.weight", float("inf")))(p),
     "state_dict.head.weight holds NaN or infinite values"),
    ("weights-changed", lambda p, b: state_with(_scaled("head.bias", 2.0))(p),
     "model_version is not the hash of its weights and config"),
    ("model-version-missing", lambda p, b: payload_with(model_version=DROP)(p),
     "no model_version"),
    ("model-version-number", lambda p, b: payload_with(model_version=12)(p),
     "model_version should be a str, not int"),
    ("model-version-forged", lambda p, b: payload_with(model_version=SECRET)(p),
     "model_version is not the hash of its weights and config"),
    ("extra-list", lambda p, b: payload_with(extra=[SECRET])(p),
     "extra should be a dict, not list"),
]


def _legacy(payload: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def _long_names(data: bytes) -> bytes:
    """Few entries, but a central directory of over 1 MiB (names of 60 KB)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
        for n in range(20):
            dst.writestr(f"{n}{SECRET}".ljust(60_000, "x"), b"")
    return out.getvalue()


def _zip_of_text() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("notes/secret.txt", SECRET)
    return buffer.getvalue()


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")
@pytest.mark.parametrize(("build", "message"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_hostile_checkpoint_is_a_checkpoint_error_that_quotes_nothing(
    good_payload: dict, good_path: Path, build: Callable, message: str,
) -> None:
    data = build(good_payload, good_path.read_bytes())
    with pytest.raises(CheckpointError, match=message) as refused:
        load_checkpoint(data)
    assert not leaked(str(refused.value))


def test_the_secret_is_planted_where_a_careless_message_would_quote_it(
    good_payload: dict, good_path: Path,
) -> None:
    """The corpus proves something: the secret is in the files' bytes, and the messages of
    torch and pydantic would have carried it."""
    assert SECRET.encode() in good_path.read_bytes()
    with pytest.raises(Exception) as raw:
        torch.load(io.BytesIO(saved({**good_payload, "extra": {"x": Planted()}})),
                   weights_only=True)
    assert "Planted" in str(raw.value)
    from pydantic import TypeAdapter, ValidationError
    with pytest.raises(ValidationError) as invalid:
        TypeAdapter(ModelSpec).validate_python({**good_payload["spec"], SECRET: 1})
    assert leaked(str(invalid.value))


def test_a_good_checkpoint_loads_from_a_path_and_from_bytes_alike(good_path: Path) -> None:
    from_path = load_checkpoint(good_path)
    from_bytes = load_checkpoint(good_path.read_bytes())
    assert from_path.digest == from_bytes.digest == content_digest(from_bytes.model, SPEC)
    assert from_path.model_version == from_bytes.model_version == version_name(
        SPEC, from_path.digest)
    assert from_path.spec == SPEC and from_path.extra == {"note": SECRET}
    assert from_path.model.training is False
    for name, tensor in from_path.model.state_dict().items():
        torch.testing.assert_close(from_bytes.model.state_dict()[name], tensor)


def test_a_source_over_the_budget_is_refused_before_it_is_read(good_path: Path) -> None:
    size = good_path.stat().st_size
    for source in (good_path, good_path.parent, good_path.read_bytes()):
        with pytest.raises(CheckpointError, match="the file is .* MiB, over the budget"):
            load_checkpoint(source, max_bytes=size - 1)
        assert load_checkpoint(source, max_bytes=size).spec == SPEC


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_the_meta_state_is_the_real_one_for_every_backbone(backbone: str) -> None:
    spec = ModelSpec(backbone=backbone, dim=8, image_size=32)
    meta = expected_state(spec)
    real = EmbeddingNet(spec).state_dict()
    assert list(meta) == list(real)
    for name, tensor in real.items():
        assert meta[name].is_meta
        assert (meta[name].shape, meta[name].dtype) == (tensor.shape, tensor.dtype), name


def test_loads_beside_model_building_in_other_threads_leave_real_models_real(
    good_path: Path,
) -> None:
    """The meta device of the checks is per thread: a model built while another thread
    checks a checkpoint (an upload beside training or ingest) has real weights."""

    def load_or_build() -> list[torch.device]:
        devices = [load_checkpoint(good_path).model.head.weight.device]
        for _ in range(20):
            devices.append(EmbeddingNet(SPEC).head.weight.device)
        return devices

    results, errors = run_in_threads(load_or_build, 6, timeout_s=120)
    assert not errors and len(results) == 6
    assert {device.type for devices in results for device in devices} == {"cpu"}


def test_every_spec_the_project_uses_is_within_bounds() -> None:
    """The sizes of training/, the demo, the benchmarks and the tests."""
    for backbone, dim, size in [("tiny_cnn", 8, 8), ("tiny_cnn", 16, 32), ("small_cnn", 64, 28),
                                ("resnet18", 128, 224), ("resnet50", 512, 224),
                                ("resnet18", 128, 64), ("vit_b_16", 128, 224)]:
        spec = ModelSpec(backbone=backbone, dim=dim, image_size=size)
        assert sum(t.numel() * 4 for t in expected_state(spec).values()) < 512 * MIB


# ------------------------------------------------------------------ memory, in a subprocess

# Loads a good checkpoint first (imports, pydantic, zipfile warm), then the hostile one; the
# growth of the peak resident size is what the hostile one cost.
_MEASURE = """
import json, resource, sys
from imgret.checkpoint import load_checkpoint
from imgret.errors import CheckpointError
from tests.support.threads import run_in_threads
load_checkpoint(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_checkpoint(sys.argv[2])
    message = None
except CheckpointError as exc:
    message = str(exc)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_mib": (after - before) / 1024, "message": message}))
"""


def peak_growth(good: Path, hostile: Path) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(good), str(hostile)],
                            capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def deflate_bomb(good_payload: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A well-formed checkpoint whose head.weight is 200 MB of zeros, its entries deflated:
    ~200 KB on disk."""
    folder = tmp_path_factory.mktemp("bomb")
    stored = folder / "stored.pt"
    state = {**good_payload["state_dict"],
             "head.weight": torch.zeros(BOMB_TENSOR_BYTES // 4)}
    torch.save({**good_payload, "state_dict": state}, stored)
    del state
    bomb = folder / "bomb.pt"
    with zipfile.ZipFile(stored) as src, zipfile.ZipFile(bomb, "w") as dst:
        for info in src.infolist():
            deflated = zipfile.ZipInfo(info.filename)
            deflated.compress_type = zipfile.ZIP_DEFLATED
            with src.open(info) as reader, dst.open(deflated, "w") as writer:
                shutil.copyfileobj(reader, writer, MIB)
    stored.unlink()
    return bomb


def test_a_deflate_bomb_is_refused_without_inflating(good_path: Path, deflate_bomb: Path
                                                      ) -> None:
    with zipfile.ZipFile(deflate_bomb) as archive:
        inflated = sum(info.file_size for info in archive.infolist())
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_DEFLATED}
    # What torch.load would have allocated: ~200 MB from a file of a few hundred KB.
    assert inflated > BOMB_TENSOR_BYTES and deflate_bomb.stat().st_size < MIB
    measured = peak_growth(good_path, deflate_bomb)
    assert "compressed entries" in measured["message"], measured
    assert measured["growth_mib"] < 50, measured


def test_a_huge_dim_is_refused_without_allocating(good_payload: dict, good_path: Path,
                                                  tmp_path: Path) -> None:
    # resnet18 with dim 5e6: the head alone is 512 x 5e6 floats, ~10 GB, had the model been
    # built from the spec.
    hostile = tmp_path / "huge.pt"
    hostile.write_bytes(spec_with(backbone="resnet18", dim=5_000_000)(good_payload))
    head = torch.nn.Linear(512, 5_000_000, device="meta")
    assert head.weight.numel() * head.weight.element_size() > 10e9
    measured = peak_growth(good_path, hostile)
    assert "spec.dim" in measured["message"], measured
    assert measured["growth_mib"] < 50, measured

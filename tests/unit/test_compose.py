"""docker-compose.yml and the Dockerfile, checked by parsing (no Docker engine here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[2]
API_SERVICES = ("api", "api-gpu", "api-milvus")


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_database_has_volume_and_health_check() -> None:
    db = _compose()["services"]["db"]
    assert db["image"].startswith("postgres:")
    assert any(v.endswith(":/var/lib/postgresql/data") for v in db["volumes"])
    assert "pg_isready" in " ".join(db["healthcheck"]["test"])


def test_api_waits_for_healthy_db_and_points_at_it() -> None:
    compose = _compose()
    db_env = compose["services"]["db"]["environment"]
    for name in API_SERVICES:
        api = compose["services"][name]
        assert api["depends_on"]["db"]["condition"] == "service_healthy"
        url = make_url(api["environment"]["IMGRET_DATABASE_URL"])
        assert url.get_backend_name() == "postgresql"
        assert (url.host, url.port, url.database) == ("db", 5432, db_env["POSTGRES_DB"])
        assert (url.username, url.password) == (db_env["POSTGRES_USER"],
                                                db_env["POSTGRES_PASSWORD"])
        data_dir = api["environment"]["IMGRET_DATA_DIR"]
        assert any(v.endswith(f":{data_dir}") for v in api["volumes"])


def test_named_volumes_are_declared() -> None:
    compose = _compose()
    declared = set(compose["volumes"])
    used = {
        v.split(":")[0]
        for service in compose["services"].values()
        for v in service.get("volumes", [])
        if not v.startswith((".", "/"))
    }
    assert used <= declared


def test_gpu_profile_requests_an_nvidia_device_and_faiss_gpu() -> None:
    gpu = _compose()["services"]["api-gpu"]
    assert gpu["profiles"] == ["gpu"]
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert gpu["build"]["args"]["GPU"] == "1"
    assert "profiles" not in _compose()["services"]["api"]


def test_dockerfile_is_multi_stage_non_root_without_compilers() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = text.split("\nFROM ")
    assert len(stages) >= 2, "expected a build stage and a runtime stage"
    final = stages[-1]
    assert "build-essential" not in final and "gcc" not in final
    assert "\nUSER " in final and "USER root" not in final
    assert "faiss-gpu" in text


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR:?message}`` rules (the subset the file uses).

    Raises:
        ValueError: a ``:?`` variable that is unset or empty (compose refuses to start).
    """

    def substitute(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3) or ""
        current = env.get(name, "")
        if op == ":?" and not current:
            raise ValueError(f"{name}: {arg}")
        if op == ":-" and not current:
            return arg
        return current

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", substitute, value)




def test_api_key_is_required_by_compose() -> None:
    """No keyless API out of `docker compose up`."""
    for name in API_SERVICES:
        raw = _compose()["services"][name]["environment"]["IMGRET_API_KEY"]
        for env in ({}, {"IMGRET_API_KEY": ""}):
            with pytest.raises(ValueError, match="set IMGRET_API_KEY"):
                _interpolate(raw, env)
        assert _interpolate(raw, {"IMGRET_API_KEY": "s3cret"}) == "s3cret"


def test_port_is_published_on_loopback_only_by_default() -> None:
    for name in API_SERVICES:
        for port in _compose()["services"][name]["ports"]:
            spec = _interpolate(str(port), {})
            host_ip, _host_port, container_port = spec.rsplit(":", 2)
            assert host_ip == "127.0.0.1", spec
            assert container_port == "8000"
            # Serving other machines is an explicit choice.
            assert _interpolate(str(port), {"IMGRET_BIND": "0.0.0.0"}).startswith("0.0.0.0:")


def test_milvus_profile_runs_standalone_milvus_and_points_the_api_at_it() -> None:
    """The `milvus` profile: Milvus standalone on etcd and MinIO, each healthy before the one
    that needs it; the API on it, with PostgreSQL still the record."""
    services = _compose()["services"]
    for name in ("etcd", "minio", "milvus", "api-milvus"):
        assert services[name]["profiles"] == ["milvus"], name
        assert "healthcheck" in services[name] or name == "api-milvus", name
    milvus = services["milvus"]
    assert milvus["image"].startswith("milvusdb/milvus:v2.")
    assert milvus["command"] == ["milvus", "run", "standalone"]
    assert milvus["environment"] == {"ETCD_ENDPOINTS": "etcd:2379", "MINIO_ADDRESS": "minio:9000"}
    assert {d: c["condition"] for d, c in milvus["depends_on"].items()} == {
        "etcd": "service_healthy", "minio": "service_healthy"}
    api = services["api-milvus"]
    env = api["environment"]
    assert env["IMGRET_INDEX_BACKEND"] == "milvus"
    assert env["IMGRET_MILVUS_URI"] == "http://milvus:19530"
    assert api["depends_on"]["milvus"]["condition"] == "service_healthy"
    assert "milvus" in api["build"]["args"]["EXTRAS"].split(",")
    from imgret.settings import Settings

    # The settings the service reads from that environment.
    settings = Settings(index_backend=env["IMGRET_INDEX_BACKEND"],
                        milvus_uri=env["IMGRET_MILVUS_URI"])
    assert (settings.index_backend, settings.milvus_uri) == ("milvus", "http://milvus:19530")
    assert "profiles" not in services["api"] and "profiles" not in services["db"]

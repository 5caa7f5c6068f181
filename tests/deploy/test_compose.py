"""docker-compose.yml and the Dockerfile agree with the code (Docker does not run here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramtune.service.cli.parser import build_parser
from vramtune.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return document


def _parses(command: list[str]) -> None:
    """The command is a vramtune command line the CLI accepts."""
    assert command[0] == "vramtune", command
    build_parser().parse_args(command[1:])


def test_compose_has_the_deployment_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"postgres", "migrate", "service", "worker"}
    postgres = compose["services"]["postgres"]
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])


def test_every_vramtune_command_parses(compose: dict[str, Any]) -> None:
    for name in ("migrate", "service", "worker"):
        _parses(compose["services"][name]["command"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    for cmd in re.findall(r"^CMD (\[.*\])$", dockerfile, flags=re.M):
        _parses(yaml.safe_load(cmd))


def test_start_order_follows_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["service"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )
    assert services["worker"]["depends_on"]["service"]["condition"] == "service_healthy"
    assert "/api/v1/health" in " ".join(services["service"]["healthcheck"]["test"])


def test_worker_reserves_nvidia_gpus(compose: dict[str, Any]) -> None:
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"
    assert "gpu" in devices[0]["capabilities"]
    assert "replicas" not in compose["services"]["worker"].get("deploy", {}), "use --scale"


def test_environment_names_exist_in_the_code(compose: dict[str, Any]) -> None:
    settings = {f"VRAMTUNE_{name.upper()}" for name in Settings.model_fields}
    # the worker's and the first-admin-token variables are read outside Settings
    worker_side = {"VRAMTUNE_SERVER", "VRAMTUNE_TOKEN", "VRAMTUNE_ADMIN_TOKEN"}
    sources = "\n".join(p.read_text() for p in (ROOT / "vramtune" / "service").rglob("*.py"))
    sources += "\n".join(p.read_text() for p in (ROOT / "vramtune" / "worker").rglob("*.py"))
    for service in compose["services"].values():
        for name in service.get("environment", {}):
            if not name.startswith("VRAMTUNE_"):
                continue
            assert name in settings or (name in worker_side and name in sources), name


def test_database_url_points_at_the_compose_postgres(compose: dict[str, Any]) -> None:
    url = compose["services"]["service"]["environment"]["VRAMTUNE_DATABASE_URL"]
    assert url.startswith("postgresql+psycopg://")
    assert "@postgres:5432/" in url
    assert compose["services"]["migrate"]["environment"]["VRAMTUNE_DATABASE_URL"] == url

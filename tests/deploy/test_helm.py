"""deploy/helm/vramtune renders with Helm's own engine and validates against Kubernetes' schemas.

No cluster and no helm binary here: helm-python-sdk (PyPI) carries Helm v4's Go library and
renders offline, as `helm template` does; kubernetes-validate (PyPI) carries the OpenAPI
schemas of each Kubernetes release. Cost: about a second for the module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from vramtune.service.auth.tokens import POLICY, PUBLIC
from vramtune.service.cli.parser import build_parser
from vramtune.service.settings import Settings

helm = pytest.importorskip("helm_python", reason="the dev extra (helm-python-sdk)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the dev extra")

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "vramtune"
PRODUCTION = yaml.safe_load((CHART / "values-production.yaml").read_text())
# The oldest release Chart.yaml admits and the newest the validator knows.
KUBERNETES = ("1.27.0", "1.37.0")
Objects = dict[tuple[str, str], dict[str, Any]]


def render(values: dict[str, Any]) -> Objects:
    """Every object `helm template vramtune CHART -n tuning` prints, by (kind, name)."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="vramtune", namespace="tuning")
    objects: Objects = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for document in yaml.safe_load_all(text):
            if document:
                objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


# README, "Running on a cluster": `helm install --set database.existingSecret=...`, then
# `helm upgrade --reuse-values --set tokens.workerExistingSecret=...` once a worker token exists.
README_INSTALL = {"database": {"existingSecret": "vramtune-database"}}
README_UPGRADE = README_INSTALL | {"tokens": {"workerExistingSecret": "vramtune-worker-token"}}
VALUES = {"default": {}, "production": PRODUCTION, "readme": README_UPGRADE}


@pytest.fixture(scope="module", params=sorted(VALUES))
def objects(request: pytest.FixtureRequest) -> Objects:
    return render(VALUES[request.param])


@pytest.mark.parametrize("version", KUBERNETES)
def test_every_object_validates_strictly(objects: Objects, version: str) -> None:
    for document in objects.values():
        kubernetes_validate.validate(document, version, strict=True)


def test_the_validator_rejects_a_wrong_field(objects: Objects) -> None:
    service = objects[("Deployment", "vramtune")]
    service["spec"]["template"]["spec"]["containers"][0]["probes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="probes"):
        kubernetes_validate.validate(service, KUBERNETES[-1], strict=True)


def test_the_chart_lints_clean() -> None:
    assert helm.lint(str(CHART))["errors"] == []


def test_default_and_production_objects() -> None:
    default = render({})
    assert set(default) == {
        ("Secret", "vramtune-database"),
        ("Secret", "vramtune-admin-token"),
        ("Job", "vramtune-migrate"),
        ("Deployment", "vramtune"),
        ("Service", "vramtune"),
        ("Deployment", "vramtune-worker"),
    }
    assert default[("Deployment", "vramtune-worker")]["spec"]["replicas"] == 0, "no worker token"
    production = render(PRODUCTION)
    assert ("Secret", "vramtune-database") not in production, "existing secrets are used"
    assert production[("Deployment", "vramtune")]["spec"]["replicas"] == 3
    assert ("PodDisruptionBudget", "vramtune") in production
    assert ("DaemonSet", "vramtune-worker") in production
    readme = render(README_UPGRADE)
    assert readme[("Deployment", "vramtune-worker")]["spec"]["replicas"] == 1, "a token: workers"
    assert ("Secret", "vramtune-admin-token") in readme, "made by the chart"


def test_the_migration_runs_as_a_hook_after_the_secrets_it_reads(objects: Objects) -> None:
    job = objects[("Job", "vramtune-migrate")]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    container = job["spec"]["template"]["spec"]["containers"][0]
    _parses(container["command"])
    assert container["command"][1:3] == ["db", "upgrade"]
    for kind, name in objects:
        if kind == "Secret":
            secret = objects[(kind, name)]["metadata"]["annotations"]
            assert "pre-install" in secret["helm.sh/hook"]
            assert int(secret["helm.sh/hook-weight"]) < int(
                job["metadata"]["annotations"]["helm.sh/hook-weight"]
            )
    secrets = {ref["name"] for ref in _secret_refs(container)}
    assert secrets == {_database_secret(objects), _admin_secret(objects)}


def test_the_service_probes_its_health_and_reads_the_database_from_a_secret(
    objects: Objects,
) -> None:
    pod = objects[("Deployment", "vramtune")]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    _parses(container["command"])
    for probe in ("startupProbe", "readinessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert POLICY[("GET", path)] is PUBLIC, f"{probe} needs no token"
    assert "tcpSocket" in container["livenessProbe"], "a database outage restarts no replica"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert {ref["name"] for ref in _secret_refs(container)} == {_database_secret(objects)}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_workers_request_gpus_and_have_time_to_hand_back(objects: Objects) -> None:
    [workers] = [o for (kind, name), o in objects.items() if name == "vramtune-worker"]
    pod = workers["spec"]["template"]["spec"]
    [container] = pod["containers"]
    _parses(container["command"])
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == container["resources"]["requests"]["nvidia.com/gpu"] >= 1
    assert ("--all-gpus" in container["command"]) == (gpus > 1)
    # A trial stops at its next step, then one REST call hands it back.
    assert pod["terminationGracePeriodSeconds"] >= 60
    env = {e["name"]: e for e in container["env"]}
    assert env["VRAMTUNE_SERVER"]["value"] == "http://vramtune:8000"


def test_environment_names_exist_in_the_code(objects: Objects) -> None:
    known = {f"VRAMTUNE_{name.upper()}" for name in Settings.model_fields}
    known |= {"VRAMTUNE_SERVER", "VRAMTUNE_TOKEN", "VRAMTUNE_ADMIN_TOKEN", "VRAMTUNE_LOG_FORMAT"}
    for document in objects.values():
        for container in _containers(document):
            for entry in container.get("env", []):
                if entry["name"].startswith("VRAMTUNE_"):
                    assert entry["name"] in known, entry["name"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"workers": {"kind": "StatefulSet"}}, "workers.kind must be Deployment or DaemonSet"),
        ({"workers": {"kind": "DaemonSet"}}, "needs tokens.workerExistingSecret"),
        ({"database": {"url": ""}}, "database.url or database.existingSecret is required"),
    ],
)
def test_bad_values_fail_with_a_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def _parses(command: list[str]) -> None:
    assert command[0] == "vramtune", command
    build_parser().parse_args(command[1:])


def _containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document.get("spec", {}).get("template", {}).get("spec", {})
    containers: list[dict[str, Any]] = spec.get("containers", [])
    return containers


def _secret_refs(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e]


def _database_secret(objects: Objects) -> str:
    return (
        "vramtune-database"
        if ("Secret", "vramtune-database") in objects
        else (PRODUCTION["database"]["existingSecret"])
    )


def _admin_secret(objects: Objects) -> str:
    return (
        "vramtune-admin-token"
        if ("Secret", "vramtune-admin-token") in objects
        else (PRODUCTION["tokens"]["adminExistingSecret"])
    )

"""One import name (issue 42): the wheel installs `vramtune` alone, and a user's project that
holds its own `common`, `service` and `worker` modules runs vramtune's commands and client.

The demo from such a folder is tests/deploy/test_demo.py's README own-code demo.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import vramtune
from tests.deploy.test_demo import user_project
from vramtune.service.testing import ServerProcess, run_vramtune, sqlite_url, upgrade_database

ROOT = Path(__file__).resolve().parents[2]


WHEEL = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w"]


def test_the_wheel_installs_one_import_name(tmp_path: Path) -> None:
    built = subprocess.run(
        [*WHEEL, str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = tmp_path.glob("vramtune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert {top.removesuffix(".py") for top in tops} == {"vramtune"}
    # the package data travels with it: the dashboard's assets and the migrations
    assert any(name.startswith("vramtune/service/static/dashboard/") for name in names)
    assert any(name.startswith("vramtune/migrations/versions/") for name in names)


def test_the_public_api_is_importable_from_the_top() -> None:
    for name in vramtune.__all__:
        assert getattr(vramtune, name) is not None, name
    assert vramtune.StudySpec.__name__ == "StudyCreate"
    with pytest.raises(AttributeError, match="no attribute 'worker_internals'"):
        _ = vramtune.worker_internals


def test_import_vramtune_and_its_client_need_no_torch() -> None:
    code = "import sys, vramtune; vramtune.Client; vramtune.StudySpec\n"
    code += "sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return user_project(tmp_path_factory.mktemp("project"))


def test_tasks_check_runs_from_a_project_with_its_own_common_service_worker(
    project: Path,
) -> None:
    task, study = (ROOT / "examples" / n for n in ("plain_task.py", "plain_task.yaml"))
    result = run_vramtune("tasks", "check", str(task), "--study", str(study), cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def server(project: Path) -> Iterator[ServerProcess]:
    url = upgrade_database(sqlite_url(project))
    process = ServerProcess(url, project / "server.log", {}, cwd=project).start()
    yield process
    process.stop()


def test_a_client_script_runs_from_a_project_with_its_own_modules(
    project: Path, server: ServerProcess
) -> None:
    script = project / "tune.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import vramtune

            spec = vramtune.StudySpec(
                name="shadowed",
                task="quadratic",
                search_space={{"x": {{"type": "float", "low": -1, "high": 1}}}},
            )
            with vramtune.Client({server.url!r}) as client:
                client.create_study(spec)
                print(client.get_study("shadowed").name, vramtune.__version__)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], cwd=project, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["shadowed", vramtune.__version__]

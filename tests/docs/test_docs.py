"""The documentation site: its reference pages match the code, and it builds with --strict."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "scripts" / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_reference_page_matches_the_code() -> None:
    stale = generator().stale_pages()
    assert stale == [], f"run scripts/docs_reference.py: {stale} are stale"


def test_a_stale_page_is_found(tmp_path: Path) -> None:
    docs = generator()
    shutil.copytree(docs.REFERENCE, tmp_path, dirs_exist_ok=True)
    page = tmp_path / "settings.md"
    page.write_text(page.read_text().replace("VRAMTUNE_PORT", "VRAMTUNE_PORT_OLD"))
    assert docs.stale_pages(tmp_path) == ["settings.md"]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "reference" / "study-file" / "index.html").exists()

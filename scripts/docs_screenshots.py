"""Opens every page of the built documentation site in headless Chromium and screenshots a few.

    .venv/bin/mkdocs build --site-dir /tmp/vramtune-site
    .venv/bin/python scripts/docs_screenshots.py /tmp/vramtune-site

Each page must load with a title and no broken image; the screenshots land in docs/screenshots/.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = {
    "": "home",
    "getting-started/own-code/": "own-code",
    "how-to/hf-trainer/": "hf-trainer",
    "concepts/plans/": "plans",
    "reference/study-file/": "reference-study-file",
}


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no line per request
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path)
    args = parser.parse_args()
    handler = functools.partial(_Quiet, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    pages = sorted(
        str(p.parent.relative_to(args.site)) + "/" for p in args.site.rglob("index.html")
    )
    out = ROOT / "docs" / "screenshots"
    out.mkdir(exist_ok=True)
    problems = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for path in pages:
            path = "" if path == "./" else path
            response = page.goto(base + path)
            broken = page.evaluate(
                "[...document.images].filter(i => !i.complete || i.naturalWidth === 0).length"
            )
            if response is None or response.status != 200 or broken or not page.title():
                problems.append(f"{path}: status {response and response.status}, {broken} broken")
            if path in SHOTS:
                page.screenshot(path=str(out / f"{SHOTS[path]}.png"))
        browser.close()
    server.shutdown()
    print(f"{len(pages)} pages opened, {len(problems)} with problems")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

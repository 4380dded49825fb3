"""Screenshot the support-matrix page for the docs, in headless Chromium (offline).

Debian's Chromium driven by Playwright (both installed by scripts/install_browser.sh);
the page is opened from disk with every network request refused, and the first
verified cell is clicked so the picture shows the evidence panel too.

    .venv/bin/python scripts/render_support_matrix.py            # support_matrix/screenshot.png
    .venv/bin/python scripts/render_support_matrix.py --page DIR/index.html --out shot.png
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def chromium_path() -> str | None:
    """Debian's chromium (Playwright's own browser download is not used)."""
    for candidate in ("/usr/bin/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or ""):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def screenshot(page_file: Path, out: Path, width: int = 1600, height: int = 900) -> Path:
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    if executable is None:
        raise SystemExit("no chromium found: run `bash scripts/install_browser.sh`")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                   else route.abort())
        page.goto(page_file.resolve().as_uri())
        page.locator('td.cell[data-status="verified"]').first.click()
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=Path, default=REPO / "support_matrix" / "index.html")
    parser.add_argument("--out", type=Path, default=REPO / "support_matrix" / "screenshot.png")
    args = parser.parse_args(argv)
    print(screenshot(args.page, args.out))


if __name__ == "__main__":
    main(sys.argv[1:])

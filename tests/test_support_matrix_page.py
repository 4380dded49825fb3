"""The support-matrix page in a real headless browser (Debian's Chromium via Playwright,
both installed by scripts/install_browser.sh): it loads offline, lists every registered
family and feature, and filtering, search, sorting and the evidence panel work.

    .venv/bin/python -m pytest -q tests/test_support_matrix_page.py
"""

import shutil
from pathlib import Path

import pytest

from mmrl.probes import PROBES
from mmrl.registry import families

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "support_matrix" / "index.html"
CHROMIUM = "/usr/bin/chromium" if Path("/usr/bin/chromium").is_file() else shutil.which("chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is installed by scripts/install_browser.sh")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: run `bash scripts/install_browser.sh`")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1600, "height": 1000}, offline=True)
    page = context.new_page()
    page.network_requests = []
    page.errors = []

    def route(route):
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            page.network_requests.append(route.request.url)
            route.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.goto(PAGE.as_uri())
    yield page
    assert page.errors == [], page.errors
    context.close()


def visible_families(page) -> list[str]:
    return page.eval_on_selector_all("#matrix tbody tr:not([hidden])", "rows => rows.map(r => r.dataset.family)")


def test_loads_offline_and_lists_every_family_and_feature(page):
    assert page.network_requests == []
    registered = [a.family for a in families()]
    assert visible_families(page) == registered
    headers = page.eval_on_selector_all("#matrix thead th", "ths => ths.map(t => t.textContent.trim())")
    assert headers == ["family", "modalities", *[p.title for p in PROBES]]
    cells = page.locator("#matrix tbody td.cell")
    assert cells.count() == len(registered) * len(PROBES)
    assert page.locator("#matrix tbody td.cell[data-status='']").count() == 0, "a cell has no probe result"
    assert page.locator("#count").text_content() == f"{len(registered)} of {len(registered)} families, " \
                                                    f"{len(PROBES)} of {len(PROBES)} features"


def test_search_filters_rows(page):
    page.fill("#search", "vl")
    shown = visible_families(page)
    assert shown and all("vl" in f for f in shown)
    assert len(shown) < len(families())
    page.fill("#search", "no-such-family")
    assert visible_families(page) == []
    page.fill("#search", "")
    assert len(visible_families(page)) == len(families())


def test_modality_filter(page):
    text_only = sorted(a.family for a in families() if a.modalities == ("text",))
    video = sorted(a.family for a in families() if "video" in a.modalities)
    page.select_option("#modality", "text-only")
    assert sorted(visible_families(page)) == text_only
    page.select_option("#modality", "video")
    assert sorted(visible_families(page)) == video
    page.select_option("#modality", "all")
    assert len(visible_families(page)) == len(families())


def test_feature_filter_hides_columns(page):
    page.click("details.features summary")
    page.uncheck("input[data-feature-toggle='rope']")
    assert page.locator("th[data-feature='rope']").is_hidden()
    assert page.locator("td[data-feature='rope']:visible").count() == 0
    assert page.locator("td[data-feature='video']:visible").count() == len(families())
    page.click("#no-features")
    assert page.locator("td.cell:visible").count() == 0
    page.click("#all-features")
    assert page.locator("td.cell:visible").count() == len(families()) * len(PROBES)


def test_status_filter(page):
    import json

    cells = json.loads((REPO / "support_matrix" / "results.json").read_text())["cells"]
    for status in ("n/a", "verified"):
        page.select_option("#status", status)
        expected = sorted({c["family"] for c in cells if c["platform"] == "cpu" and c["status"] == status})
        assert sorted(visible_families(page)) == expected


def test_sort_by_family_and_by_feature(page):
    names = [a.family for a in families()]
    header = page.locator("th[data-sort='family']")
    header.click()
    assert visible_families(page) == sorted(names)
    header.click()
    assert visible_families(page) == sorted(names, reverse=True)
    assert header.get_attribute("aria-sort") == "descending"
    page.locator("th[data-sort='video']").click()  # not-run/verified before n/a
    ranks = page.eval_on_selector_all("#matrix tbody tr", "rows => rows.map(r => "
                                      "Number(r.querySelector('td[data-feature=video]').dataset.rank))")
    assert ranks == sorted(ranks)


def test_evidence_on_hover_and_click(page):
    cell = page.locator("tr[data-family='qwen2'] td[data-feature='padding_free']")
    assert "CPU: verified" in cell.get_attribute("title")
    cell.click()
    panel = page.locator("#evidence")
    text = panel.text_content()
    assert "qwen2 / Padding-free" in text and "packed" in text and "max_abs_diff" in text
    assert "torch" in text and "cpu" in text

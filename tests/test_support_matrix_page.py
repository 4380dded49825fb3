"""The support-matrix page in a real headless browser (Debian's Chromium via Playwright,
both installed by scripts/install_browser.sh): it loads offline, lists every registered
family and feature, shows every column at 1280 and 1440 px and a clicked cell's evidence
without scrolling the page, explains cells a reader would wonder about (n/a although
declared, GPU cells not recorded), and filtering, search, sorting and the evidence panel work.

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
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium: run `bash scripts/install_browser.sh`"),
              pytest.mark.slow]  # a real browser


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


def open_page(browser, path: Path = PAGE, width: int = 1600, height: int = 1000):
    context = browser.new_context(viewport={"width": width, "height": height}, offline=True)
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
    page.goto(path.as_uri())
    return context, page


@pytest.fixture
def page(browser):
    context, page = open_page(browser)
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


@pytest.mark.parametrize("width", [1280, 1440])
def test_every_column_fits_the_window(browser, width):
    context, page = open_page(browser, width=width, height=800)
    right = page.eval_on_selector_all("#matrix thead th",
                                      "ths => Math.max(...ths.map(t => t.getBoundingClientRect().right))")
    assert right <= width, f"the last column ends at {right:.0f} px in a {width} px window"
    overflow = page.eval_on_selector(".scroll", "s => s.scrollWidth - s.clientWidth")
    assert overflow <= 0, f"the table scrolls sideways by {overflow} px at {width} px"
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    context.close()


def test_evidence_shows_without_scrolling_the_page(browser):
    context, page = open_page(browser, width=1280, height=800)
    last = families()[-1].family
    page.eval_on_selector(f"tr[data-family='{last}'] td[data-feature='{PROBES[-1].feature}']", "td => td.click()")
    title = page.locator("#evidence h2")
    assert title.text_content() == f"{last} / {PROBES[-1].title}"
    box = title.bounding_box()
    assert box is not None and 0 <= box["y"] and box["y"] + box["height"] <= 800, box
    assert page.evaluate("window.scrollY") == 0
    # Scrolled to the end of the page, the panel stays in view.
    page.evaluate("window.scrollTo(0, document.documentElement.scrollHeight)")
    box = title.bounding_box()
    assert box is not None and 0 <= box["y"] <= 800 - box["height"], box
    context.close()


def test_declared_but_inapplicable_cells_are_explained(page):
    import json

    cells = json.loads((REPO / "support_matrix" / "results.json").read_text())["cells"]
    declared_na = {(c["family"], c["feature"]) for c in cells
                   if c["platform"] == "cpu" and c["status"] == "n/a" and c["declared"] is True}
    for family, feature in declared_na:
        badge = page.locator(f"tr[data-family='{family}'] td[data-feature='{feature}'] .badge").first
        assert "declared" in badge.get_attribute("class").split()
        assert "does not apply" in page.locator(
            f"tr[data-family='{family}'] td[data-feature='{feature}']").get_attribute("title")
    notes = page.locator("#notes").text_content() if page.locator("#notes").count() else ""
    for feature in {f for _, f in declared_na}:
        assert f"although their adapters declare {feature}" in notes


def test_missing_gpu_cells_are_explained(browser, tmp_path):
    import json

    from mmrl.probes.render import render_html

    document = json.loads((REPO / "support_matrix" / "results.json").read_text())
    gpu = [c for c in document["cells"] if c["platform"] == "gpu"]
    if not gpu:
        pytest.skip("no GPU cells recorded in support_matrix/results.json")
    dropped = gpu[0]
    document["cells"] = [c for c in document["cells"] if c is not dropped]
    (tmp_path / "index.html").write_text(render_html(document))
    context, page = open_page(browser, tmp_path / "index.html")
    notes = page.locator("#notes")
    assert notes.is_visible()
    text = notes.text_content()
    assert f"no GPU cell for {dropped['family']}" in text and "not recorded on a GPU" in text
    assert f"--feature {dropped['feature']}" in text
    context.close()

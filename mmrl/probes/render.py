"""Render a support-matrix document (results.json) as Markdown and as one static HTML page.

Both are pure functions of the document, so `mmrl support-matrix --check` can tell a
hand-edited or outdated page from a generated one. The HTML page is self-contained:
styles, script and data are inline, and it loads nothing from the network.
"""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from typing import Any

# status -> (symbol, words) for cells whose feature is declared or required, and for
# cells whose capability the family does not declare.
SYMBOLS = {
    ("verified", True): ("✅", "verified"),
    ("verified", False): ("☑️", "verified, works but not declared"),
    ("failed", True): ("❌", "failed: a declared or required feature (CI fails)"),
    ("failed", False): ("⚠️", "failed, not declared (not a CI failure)"),
    ("n/a", True): ("➖", "not applicable to the family"),
    ("not run here", True): ("⏸️", "not run here: needs hardware, a package or an mmrl component absent here"),
}
STATUS_ORDER = {"failed": 0, "not run here": 1, "verified": 2, "n/a": 3}
# The page uses plain symbols: a browser without an emoji font still shows them.
HTML_SYMBOLS = {"✅": "✓", "☑️": "✓", "❌": "✗", "⚠️": "!", "➖": "–", "⏸️": "○"}


def symbol(cell: dict[str, Any]) -> str:
    status = cell["status"]
    if status in ("n/a", "not run here"):
        return SYMBOLS[(status, True)][0]
    return SYMBOLS[(status, cell["declared"] is not False)][0]


def _short(value: float) -> str:
    """1.234e-05 -> '1e-5': a figure that fits a matrix cell."""
    mantissa, _, exponent = f"{value:.0e}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def figure(cell: dict[str, Any]) -> str:
    """A probe's headline figure beside its bound ('3e-7 ≤ 1e-4'), when its evidence
    holds one (`{"figure": {"value", "bound", "what"}}`), else ''."""
    shown = (cell.get("evidence") or {}).get("figure")
    if not isinstance(shown, dict) or not isinstance(shown.get("value"), (int, float)):
        return ""
    relation = "≤" if shown["value"] <= shown["bound"] else ">"
    return f"{_short(shown['value'])} {relation} {_short(shown['bound'])}"


def _gate(cell: dict[str, Any]) -> str:
    if cell["declared"] is False:
        return "not declared"
    if cell["platform"] == "cpu":
        return "declared or required: CI fails"
    return "declared or required; recorded, not gated"


def _footnotes(failures: list[dict], platform: str) -> dict[tuple[str, str], int]:
    listed = [c for c in failures if c["platform"] == platform]
    return {(c["family"], c["feature"]): i for i, c in enumerate(listed, 1)}


def _index(document: dict[str, Any]) -> dict[tuple[str, str, str], dict]:
    return {(c["family"], c["feature"], c["platform"]): c for c in document["cells"]}


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _versions(version: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in version.items())


def _provenance(cells: list[dict]) -> list[str]:
    """One line per distinct (device, versions) among cells, with their dates."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        groups[(c["device"], _versions(c["versions"]))].append(c)
    lines = []
    for (device, version), members in sorted(groups.items()):
        dates = sorted({c["date"] for c in members})
        when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
        lines.append(f"{len(members)} cells on {device}: {version}; recorded {when}.")
    return lines


def _notes(document: dict[str, Any]) -> list[str]:
    """Plain-text notes on cells a reader would otherwise wonder about: n/a although the
    family declares the capability, and GPU cells missing where other GPU cells exist."""
    titles = {f["feature"]: f["title"] for f in document["features"]}
    index = _index(document)
    notes = []
    declared_na: dict[tuple[str, str], list[str]] = defaultdict(list)
    for c in document["cells"]:
        if c["platform"] == "cpu" and c["status"] == "n/a" and c["declared"] is True:
            declared_na[(c["feature"], c["reason"])].append(c["family"])
    for (feature, reason), names in sorted(declared_na.items(), key=lambda kv: list(titles).index(kv[0][0])):
        notes.append(f"{titles[feature]} is n/a for {', '.join(names)}, although their adapters declare "
                     f"{feature}: {reason}. The feature has nothing to act on there, so no probe runs and "
                     "nothing is gated.")
    recorded = {c["family"] for c in document["cells"] if c["platform"] == "gpu"}
    if recorded:
        missing: dict[str, list[str]] = defaultdict(list)
        for family in document["families"]:
            for f in document["features"]:
                if family["family"] in recorded and (family["family"], f["feature"], "gpu") not in index:
                    missing[f["feature"]].append(family["family"])
        for feature, names in missing.items():
            notes.append(f"{titles[feature]}: no GPU cell for {', '.join(names)}: not recorded on a GPU yet (record "
                         f"it with `mmrl support-matrix --device cuda --feature {feature}` on a GPU machine and merge "
                         "with `--gpu-results`); the CPU cell is shown alone.")
        unrecorded = [f["family"] for f in document["families"] if f["family"] not in recorded]
        if unrecorded:
            notes.append(f"No GPU cells recorded for {', '.join(unrecorded)}.")
    return notes


def _table(document: dict[str, Any], platform: str, footnotes: dict[tuple[str, str], int]) -> list[str]:
    index = _index(document)
    features = document["features"]
    lines = ["| family | modalities | " + " | ".join(f["title"] for f in features) + " |",
             "|---|---|" + "---|" * len(features)]
    present = {c["family"] for c in document["cells"] if c["platform"] == platform}
    for family in document["families"]:
        if family["family"] not in present:
            continue
        row = [f"`{family['family']}`", ", ".join(m for m in family["modalities"] if m != "text") or "text"]
        for feature in features:
            c = index.get((family["family"], feature["feature"], platform))
            if c is None:
                row.append(" ")
                continue
            mark = " ".join(filter(None, (symbol(c), figure(c))))
            note = footnotes.get((c["family"], c["feature"]))
            row.append(f"{mark} ({note})" if note else mark)
        lines.append("| " + " | ".join(row) + " |")
    return lines


def render_markdown(document: dict[str, Any]) -> str:
    features = document["features"]
    titles = {f["feature"]: f["title"] for f in features}
    cpu = [c for c in document["cells"] if c["platform"] == "cpu"]
    gpu = [c for c in document["cells"] if c["platform"] == "gpu"]
    out = [
        "# Support matrix",
        "",
        "Generated by `mmrl support-matrix` from [`results.json`](results.json): do not edit by hand.",
        "Each cell is the outcome of a probe that ran the feature on the family's tiny random-init model.",
        "[docs/support_matrix.md](../docs/support_matrix.md) explains the columns, the statuses and how to",
        "regenerate; [`index.html`](index.html) is the same matrix as a page (filter, search, sort, evidence).",
        "",
        "**Legend:** " + " · ".join(f"{sym} {words}" for sym, words in SYMBOLS.values()),
        "",
        f"{len(document['families'])} families × {len(features)} features.",
    ]
    out += [""] + [f"- CPU: {line}" for line in _provenance(cpu)]
    if gpu:
        out += [f"- GPU: {line}" for line in _provenance(gpu)]

    failures = [c for c in document["cells"] if c["status"] == "failed"]
    footnotes = _footnotes(failures, "cpu")
    if cpu:
        out += ["", "## On CPU", ""] + _table(document, "cpu", footnotes)
    if gpu:
        gpu_notes = _footnotes(failures, "gpu")
        out += ["", "## Recorded on GPU", "", "Cells recorded with `mmrl support-matrix --device cuda` on a GPU "
                "machine and merged with `--gpu-results`; families without GPU cells are left out.", ""]
        out += _table(document, "gpu", gpu_notes)

    out += ["", "## Failures", ""]
    if not failures:
        out.append("None: every probe that ran passed.")
    for platform in ("cpu", "gpu"):
        listed = [c for c in failures if c["platform"] == platform]
        for i, c in enumerate(listed, 1):
            gate = _gate(c)
            where = "" if platform == "cpu" else " on GPU"
            out.append(f"{i}. `{c['family']}` / {titles[c['feature']]}{where} ({gate}): {_md(c['reason'])}")

    notes = _notes(document)
    if notes:
        out += ["", "## Notes", ""] + [f"- {_md(note)}" for note in notes]

    not_run: dict[tuple[str, str], list[str]] = defaultdict(list)
    for c in cpu:
        if c["status"] == "not run here":
            not_run[(c["feature"], c["reason"])].append(c["family"])
    out += ["", "## Not run here", ""]
    if not not_run:
        out.append("Every applicable probe ran on this machine.")
    for (feature, reason), names in sorted(not_run.items(), key=lambda kv: list(titles).index(kv[0][0])):
        applicable = {c["family"] for c in cpu if c["feature"] == feature and c["status"] != "n/a"}
        who = "every family it applies to" if set(names) == applicable else \
            f"{len(names)} families: " + ", ".join(f"`{n}`" for n in names)
        out.append(f"- {titles[feature]}: {_md(reason)} ({who})")

    out += ["", "## Features", "", "| column | capability | what the probe checks |", "|---|---|---|"]
    for f in features:
        capability = f"`{f['capability']}`" if f["capability"] else "required of every family"
        out.append(f"| {f['title']} | {capability} | {_md(f['description'])} |")

    out += ["", "## Evidence", ""]
    index = _index(document)
    for family in document["families"]:
        cells = [index[k] for f in features for k in [(family["family"], f["feature"], p) for p in ("cpu", "gpu")]
                 if k in index]
        counts = Counter(c["status"] for c in cells if c["platform"] == "cpu")
        summary = ", ".join(f"{counts[s]} {s}" for s in ("verified", "failed", "n/a", "not run here") if counts[s])
        out += [f"<details><summary><code>{family['family']}</code> ({', '.join(family['modalities'])}): {summary}"
                "</summary>", "", "| feature | where | status | reason | seconds |", "|---|---|---|---|---|"]
        for c in cells:
            status = f"{symbol(c)} {c['status']}" + (", not declared" if c["declared"] is False and
                                                     c["status"] in ("verified", "failed") else "")
            where = c["platform"] if c["platform"] == "cpu" else f"gpu: {c['device']}"
            status += f" ({figure(c)})" if figure(c) else ""
            out.append(f"| {titles[c['feature']]} | {_md(where)} | {status} | {_md(c['reason'])} "
                       f"| {c['seconds']:.2f} |")
        out += ["", "</details>", ""]
    return "\n".join(out).rstrip() + "\n"


# -- HTML --------------------------------------------------------------------------------
CSS = """
:root { --ok:#1a7f37; --ok-bg:#dafbe1; --soft-bg:#eef7ee; --bad:#cf222e; --bad-bg:#ffebe9; --warn:#9a6700;
        --warn-bg:#fff8c5; --na:#6e7781; --na-bg:#f6f8fa; --skip:#0550ae; --skip-bg:#ddf4ff; --line:#d0d7de;
        --panel: 360px; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1f2328; }
header, main { padding: 0 16px; }
h1 { font-size: 22px; margin: 12px 0 4px; }
.meta { color: #57606a; margin: 0 0 6px; }
ul.meta { padding-left: 18px; }
.controls { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; padding: 8px 0;
            border-top: 1px solid var(--line); border-bottom: 1px solid var(--line); }
.controls label { display: inline-flex; gap: 4px; align-items: center; }
input[type=search] { padding: 5px 8px; min-width: 220px; border: 1px solid var(--line); border-radius: 6px; }
select, button { padding: 4px 8px; border: 1px solid var(--line); border-radius: 6px; background: #fff; }
details.features { margin: 0; }
details.features .boxes { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr));
                          gap: 2px 12px; padding: 8px 0; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 10px; margin: 6px 0; font-size: 13px; }
/* The matrix beside a sticky evidence panel: a clicked cell's evidence shows without
   scrolling the page. Narrow windows stack them, and the panel sticks to the bottom. */
main { display: grid; grid-template-columns: minmax(0, 1fr) var(--panel); gap: 16px; align-items: start; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid var(--line); padding: 2px 3px; text-align: center; white-space: nowrap; }
th { background: #f6f8fa; cursor: pointer; user-select: none; font-weight: 600; font-size: 12px;
     line-height: 1.2; vertical-align: bottom; }
/* Feature titles read bottom to top, so all 19+ columns fit 1280 px. */
th.feature { padding: 4px 2px; }
th.feature span { writing-mode: vertical-rl; transform: rotate(180deg); display: inline-block; }
th[aria-sort=ascending]::after { content: "▲"; display: block; }
th[aria-sort=descending]::after { content: "▼"; display: block; }
/* The family column stays in view when a narrow window scrolls the table sideways. */
td.family, th.family { position: sticky; left: 0; z-index: 1; text-align: left; }
td.family { background: #fff; font-family: ui-monospace, monospace; }
td.modalities { color: #57606a; text-align: left; white-space: normal; font-size: 12px; min-width: 64px; }
td.cell { cursor: pointer; min-width: 30px; }
td.cell:focus, td.cell.selected { outline: 2px solid #0969da; outline-offset: -2px; }
.badge { display: inline-block; min-width: 22px; padding: 0 4px; border-radius: 10px; font-weight: 700; }
.verified { color: var(--ok); background: var(--ok-bg); }
.verified.undeclared { color: var(--ok); background: var(--soft-bg); border: 1px dashed var(--ok); }
.failed { color: var(--bad); background: var(--bad-bg); }
.failed.undeclared { color: var(--warn); background: var(--warn-bg); }
.na { color: var(--na); background: var(--na-bg); }
.na.declared { border: 1px dotted var(--na); }
.notrun { color: var(--skip); background: var(--skip-bg); }
.gpu { display: block; width: max-content; margin: 1px auto 0; font-size: 10px; line-height: 1.2; min-width: 18px; }
.legend .gpu { display: inline-block; }
/* A probe's figure beside its bound (rollout agreement), small enough for the column. */
.figure { display: block; font-size: 8px; line-height: 1.1; letter-spacing: -0.2px; margin: 0 -2px; color: #57606a; }
aside#evidence { border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px; margin: 8px 0;
                 position: sticky; top: 8px; max-height: calc(100vh - 16px); overflow: auto; background: #fff;
                 z-index: 2; }
aside#evidence .platform { margin-bottom: 8px; }
aside#evidence h3 { font-size: 14px; margin: 8px 0 2px; }
aside#evidence h2 { font-size: 15px; margin: 0 0 6px; }
aside#evidence dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 8px; margin: 6px 0; }
aside#evidence dt { color: #57606a; } aside#evidence dd { margin: 0; word-break: break-word; }
aside#evidence pre { background: #f6f8fa; padding: 6px; white-space: pre-wrap; font-size: 12px; margin: 4px 0; }
@media (max-width: 1100px) {
  main { display: block; }
  aside#evidence { position: sticky; bottom: 0; top: auto; max-height: 45vh; box-shadow: 0 -2px 8px #0002; }
}
.empty { color: #57606a; }
#count { color: #57606a; }
#failures h2, #notes h2 { font-size: 15px; margin: 8px 0 4px; } #failures ul, #notes ul { margin: 0; }
#notes { color: #57606a; }
"""

SCRIPT = r"""
(function () {
  const data = JSON.parse(document.getElementById("matrix-data").textContent);
  const cells = {};
  for (const c of data.cells) cells[c.family + "\u0000" + c.feature + "\u0000" + c.platform] = c;
  const table = document.getElementById("matrix");
  const body = table.tBodies[0];
  const rows = Array.from(body.rows);
  const search = document.getElementById("search");
  const modality = document.getElementById("modality");
  const statusFilter = document.getElementById("status");
  const boxes = Array.from(document.querySelectorAll("input[data-feature-toggle]"));
  const count = document.getElementById("count");
  const panel = document.getElementById("evidence");

  function shownFeatures() {
    return new Set(boxes.filter(b => b.checked).map(b => b.dataset.featureToggle));
  }
  function apply() {
    const query = search.value.trim().toLowerCase();
    const mod = modality.value;
    const wanted = statusFilter.value;
    const features = shownFeatures();
    document.querySelectorAll("[data-feature]").forEach(el => {
      el.hidden = !features.has(el.dataset.feature);
    });
    let visible = 0;
    for (const row of rows) {
      const mods = row.dataset.modalities.split(" ");
      let ok = !query || row.dataset.search.includes(query);
      if (mod === "text-only") ok = ok && mods.length === 1;
      else if (mod !== "all") ok = ok && mods.includes(mod);
      if (wanted !== "any") {
        ok = ok && Array.from(row.querySelectorAll("td.cell")).some(td =>
          !td.hidden && td.dataset.status === wanted);
      }
      row.hidden = !ok;
      if (ok) visible++;
    }
    count.textContent = visible + " of " + rows.length + " families, " + features.size + " of " +
      boxes.length + " features";
  }
  function sortBy(th) {
    const key = th.dataset.sort;
    const direction = th.getAttribute("aria-sort") === "ascending" ? "descending" : "ascending";
    table.querySelectorAll("th").forEach(h => h.removeAttribute("aria-sort"));
    th.setAttribute("aria-sort", direction);
    const sign = direction === "ascending" ? 1 : -1;
    const value = row => {
      if (key === "family") return row.dataset.family;
      if (key === "modalities") return row.dataset.modalities;
      const td = row.querySelector('td[data-feature="' + key + '"]');
      return td ? Number(td.dataset.rank) : 9;
    };
    const sorted = rows.slice().sort((a, b) => {
      const x = value(a), y = value(b);
      if (x < y) return -sign;
      if (x > y) return sign;
      return a.dataset.family < b.dataset.family ? -1 : 1;
    });
    for (const row of sorted) body.appendChild(row);
  }
  function text(tag, content) {
    const el = document.createElement(tag);
    el.textContent = content;
    return el;
  }
  function describe(c) {
    const box = document.createElement("div");
    box.className = "platform";
    box.appendChild(text("h3", c.platform.toUpperCase() + ": " + c.status +
      (c.declared === false ? " (not declared)" : c.declared === null ? " (required)" :
       c.status === "n/a" ? " (declared, but does not apply: nothing to verify)" : " (declared)")));
    const dl = document.createElement("dl");
    const add = (k, v) => { dl.appendChild(text("dt", k)); dl.appendChild(text("dd", v)); };
    add("reason", c.reason);
    add("time", c.seconds.toFixed(2) + " s");
    add("device", c.device);
    add("versions", Object.entries(c.versions).map(kv => kv.join(" ")).join(", "));
    add("date", c.date);
    box.appendChild(dl);
    if (c.evidence && Object.keys(c.evidence).length) {
      box.appendChild(text("pre", JSON.stringify(c.evidence, null, 1)));
    }
    return box;
  }
  function show(td) {
    document.querySelectorAll("td.cell.selected").forEach(el => el.classList.remove("selected"));
    td.classList.add("selected");
    const family = td.parentElement.dataset.family, feature = td.dataset.feature;
    const meta = data.features.find(f => f.feature === feature);
    panel.replaceChildren();
    panel.appendChild(text("h2", family + " / " + meta.title));
    panel.appendChild(text("p", meta.description + (meta.capability ? " Capability: " + meta.capability + "." :
      " Required of every family.")));
    for (const platform of ["cpu", "gpu"]) {
      const c = cells[family + "\u0000" + feature + "\u0000" + platform];
      if (c) panel.appendChild(describe(c));
    }
  }
  search.addEventListener("input", apply);
  modality.addEventListener("change", apply);
  statusFilter.addEventListener("change", apply);
  boxes.forEach(b => b.addEventListener("change", apply));
  const setAll = on => () => { boxes.forEach(b => b.checked = on); apply(); };
  document.getElementById("all-features").addEventListener("click", setAll(true));
  document.getElementById("no-features").addEventListener("click", setAll(false));
  table.querySelectorAll("th[data-sort]").forEach(th => th.addEventListener("click", () => sortBy(th)));
  body.addEventListener("click", e => { const td = e.target.closest("td.cell"); if (td) show(td); });
  body.addEventListener("keydown", e => {
    const td = e.target.closest("td.cell");
    if (td && (e.key === "Enter" || e.key === " ")) { e.preventDefault(); show(td); }
  });
  apply();
})();
"""

_CLASS = {"verified": "verified", "failed": "failed", "n/a": "na", "not run here": "notrun"}


def _badge(cell: dict[str, Any], extra: str = "") -> str:
    undeclared = " undeclared" if cell["declared"] is False and cell["status"] in ("verified", "failed") else ""
    declared_na = " declared" if cell["declared"] is True and cell["status"] == "n/a" else ""
    return (f'<span class="badge {_CLASS[cell["status"]]}{undeclared}{declared_na}{extra}">'
            f'{HTML_SYMBOLS[symbol(cell)]}</span>')


def _figure_html(cell: dict[str, Any]) -> str:
    """The cell's figure and bound on two short lines under its badge ('' without one)."""
    text = figure(cell)
    if not text:
        return ""
    value, relation, bound = text.split(" ")
    return f'<span class="figure">{html.escape(value)}<br>{html.escape(relation + bound)}</span>'


def _tooltip(cell: dict[str, Any]) -> str:
    note = " (not declared)" if cell["declared"] is False and cell["status"] in ("verified", "failed") else ""
    if cell["declared"] is True and cell["status"] == "n/a":
        note = " (declared, but does not apply: nothing to verify)"
    return f"{cell['platform'].upper()}: {cell['status']}{note}: {cell['reason']}"


def render_html(document: dict[str, Any]) -> str:
    e = html.escape
    index = _index(document)
    features = document["features"]
    cpu = [c for c in document["cells"] if c["platform"] == "cpu"]
    gpu = [c for c in document["cells"] if c["platform"] == "gpu"]
    counts = Counter(c["status"] for c in cpu)

    head = ['<th class="family" data-sort="family" scope="col">family</th>',
            '<th data-sort="modalities" scope="col">modalities</th>']
    head += [f'<th class="feature" data-sort="{e(f["feature"])}" data-feature="{e(f["feature"])}" scope="col" '
             f'title="{e(f["description"])}"><span>{e(f["title"])}</span></th>' for f in features]
    body = []
    for family in document["families"]:
        name = family["family"]
        words = " ".join([name, *family["model_types"], *family["modalities"]]).lower()
        tds = [f'<td class="family">{e(name)}</td>',
               f'<td class="modalities">{e(", ".join(m for m in family["modalities"] if m != "text") or "text")}</td>']
        for f in features:
            c = index.get((name, f["feature"], "cpu"))
            g = index.get((name, f["feature"], "gpu"))
            if c is None and g is None:
                tds.append(f'<td class="cell" data-feature="{e(f["feature"])}" data-status="" data-rank="9"></td>')
                continue
            main = c or g
            tip = "\n".join(_tooltip(x) for x in (c, g) if x)
            inner = _badge(main) + _figure_html(main) + (_badge(g, " gpu") + _figure_html(g) if c and g else "")
            tds.append(f'<td class="cell" tabindex="0" data-feature="{e(f["feature"])}" '
                       f'data-status="{e(main["status"])}" data-rank="{STATUS_ORDER[main["status"]]}" '
                       f'title="{e(tip)}">{inner}</td>')
        body.append(f'<tr data-family="{e(name)}" data-modalities="{e(" ".join(family["modalities"]))}" '
                    f'data-search="{e(words)}">' + "".join(tds) + "</tr>")

    toggles = "".join(f'<label><input type="checkbox" checked data-feature-toggle="{e(f["feature"])}"> '
                      f'{e(f["title"])}</label>' for f in features)
    legend = "".join(
        f'<span>{_badge({"status": status, "declared": declared, "platform": "cpu"})} {e(words)}</span>'
        for (status, declared), (sym, words) in SYMBOLS.items())
    legend += '<span><span class="badge na declared">–</span> n/a, though the family declares it (see Notes)</span>'
    if gpu:
        legend += '<span><span class="badge verified">✓</span><span class="badge verified gpu">✓</span> ' \
                  'second, small badge: the cell recorded on a GPU (none: not recorded there, see Notes)</span>'
    provenance = "".join(f"<li>CPU: {e(line)}</li>" for line in _provenance(cpu))
    provenance += "".join(f"<li>GPU: {e(line)}</li>" for line in _provenance(gpu))
    data = json.dumps(document, sort_keys=True, ensure_ascii=True).replace("</", "<\\/")
    summary = ", ".join(f"{counts[s]} {s}" for s in ("verified", "failed", "not run here", "n/a") if counts[s])
    titles = {f["feature"]: f["title"] for f in features}
    failed = [c for c in document["cells"] if c["status"] == "failed"]
    failures = "".join(
        f'<li><code>{e(c["family"])}</code> / {e(titles[c["feature"]])} ({c["platform"].upper()}, '
        f'{_gate(c)}): {e(c["reason"])}</li>'
        for c in failed) or "<li>none: every probe that ran passed</li>"
    notes = "".join(f"<li>{e(note)}</li>" for note in _notes(document))
    notes = f'<section id="notes"><h2>Notes</h2><ul>{notes}</ul></section>' if notes else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>mmrl support matrix</title>
<style>{CSS}</style>
</head>
<body>
<header>
<h1>mmrl support matrix</h1>
<p class="meta">{len(document["families"])} families × {len(features)} features on CPU: {e(summary)}.
Generated by <code>mmrl support-matrix</code>; every cell comes from a probe that ran.
Click a cell for its evidence.</p>
<ul class="meta">{provenance}</ul>
<div class="legend">{legend}</div>
<div class="controls">
<label>Search <input type="search" id="search" placeholder="family or model type" autocomplete="off"></label>
<label>Modality <select id="modality">
<option value="all">all</option><option value="text-only">text only</option>
<option value="image">image</option><option value="video">video</option></select></label>
<label>Status <select id="status">
<option value="any">any</option><option value="verified">verified</option><option value="failed">failed</option>
<option value="not run here">not run here</option><option value="n/a">n/a</option></select></label>
<span id="count"></span>
</div>
<details class="features"><summary>Features (columns)</summary>
<button type="button" id="all-features">all</button> <button type="button" id="no-features">none</button>
<div class="boxes">{toggles}</div></details>
</header>
<main>
<div class="matrix-area">
<div class="scroll">
<table id="matrix">
<thead><tr>{"".join(head)}</tr></thead>
<tbody>
{chr(10).join(body)}
</tbody>
</table>
</div>
<section id="failures"><h2>Failures</h2><ul>{failures}</ul></section>
{notes}
<footer><p class="meta">Statuses and columns: docs/support_matrix.md in the mmrl repository.</p></footer>
</div>
<aside id="evidence" aria-live="polite"><p class="empty">Click a cell (or hover it) to see its evidence: the
probe's reason, measurements, time, device, versions and date.</p></aside>
</main>
<script type="application/json" id="matrix-data">{data}</script>
<script>{SCRIPT}</script>
</body>
</html>
"""

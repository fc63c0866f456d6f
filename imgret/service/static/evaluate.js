// Evaluate view: POST /evaluate {query_set, model_version, worst} and show the report: the
// metrics with their 95% intervals (an inline SVG chart), the per-label table and the worst
// queries as rows of images (relevant neighbours framed green, irrelevant red); with an
// open_set section, its DET and TAR@FAR plots, operating points and threshold slider
// (openset.js).
"use strict";

(() => {
  const { api, statusSetter, el, fmt, fillSelect } = imgret;
  const form = document.getElementById("evaluate-form");
  const setSelect = document.getElementById("eval-query-set");
  const versionSelect = document.getElementById("eval-version");
  const fpirsInput = document.getElementById("eval-fpirs");
  const unknownInput = document.getElementById("eval-unknown");
  const button = document.getElementById("evaluate-button");
  const output = document.getElementById("eval-report");
  const setStatus = statusSetter(document.getElementById("eval-status"));
  const WORST = 8;
  const SVG = "http://www.w3.org/2000/svg";

  async function show() {
    try {
      const [sets, listing] = await Promise.all([imgret.querySets(), imgret.models()]);
      fillSelect(setSelect, sets.map((s) => ({ value: s.name, text: `${s.name} (${s.size} queries)` })));
      fillSelect(versionSelect, listing.models.map((m) => ({
        value: m.version, text: m.active ? `${m.version} (active)` : m.version,
      })), { selected: listing.active });
      button.disabled = sets.length === 0;
      if (sets.length === 0) {
        setStatus("no query set is stored yet: add one with `imgret ingest FOLDER --query-set NAME`");
      }
    } catch (err) {
      setStatus(`could not load query sets or models: ${err.message}`, true);
    }
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = { query_set: setSelect.value, worst: WORST };
    if (versionSelect.value) body.model_version = versionSelect.value;
    // The server checks the values (each FPIR in (0, 1), each label in the query set) and
    // its message is shown as it is; the page only splits the lists.
    const fpirs = listOf(fpirsInput.value);
    if (fpirs.length) body.fpirs = fpirs.map(Number);
    const unknown = listOf(unknownInput.value);
    if (unknown.length) body.unknown_labels = unknown;
    setStatus(`evaluating ${body.query_set}…`);
    button.disabled = true;
    output.setAttribute("aria-busy", "true");
    try {
      const answer = await api("/evaluate", { method: "POST", json: body });
      if (!answer.ok) {
        setStatus(answer.error, true);
        return;
      }
      render(answer.body);
      const r = answer.body;
      setStatus(`${r.num_queries} queries of ${r.query_set} · MAP@R ${fmt(r.map_at_r)} · model ${r.model_version}`);
    } catch (err) {
      setStatus(`request failed: ${err}`, true);
    } finally {
      button.disabled = false;
      output.setAttribute("aria-busy", "false");
    }
  });

  function listOf(text) {
    return text.split(",").map((part) => part.trim()).filter((part) => part !== "");
  }

  function render(report) {
    output.replaceChildren(
      el("p", { cls: "muted", text: `${report.protocol} · gallery ${report.gallery_size} · ` +
        `${report.num_queries} queries (${report.num_skipped} without a relevant item skipped)` }),
      el("h3", { text: "Metrics (bars: value, whiskers: 95% bootstrap interval)" }),
      chart(report),
      el("h3", { text: "Per label (worst first)" }),
      labelTable(report.per_label || []),
      ...imgret.openSet.render(report),
      el("h3", { text: `Worst ${(report.worst || []).length} queries` }),
      worstRows(report),
    );
  }

  function metricRows(report) {
    const ci = report.ci95 || {};
    const rows = [
      ["map_at_r", "MAP@R"], ["r_precision", "R-Precision"], ["precision_at_1", "P@1"],
      ["mean_average_precision", "mAP"],
    ].map(([key, name]) => ({ key, name, value: report[key], interval: ci[key] }));
    const ks = Object.keys(report.recall_at_k || {}).sort((a, b) => Number(a) - Number(b));
    for (const k of ks) {
      rows.push({ key: `recall_at_${k}`, name: `Recall@${k}`, value: report.recall_at_k[k],
        interval: (ci.recall_at_k || {})[k] });
    }
    return rows;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /** Horizontal bars on a 0..1 scale with interval whiskers. */
  function chart(report) {
    const rows = metricRows(report);
    const left = 110, width = 400, right = 150, rowH = 28, top = 8, axis = 22;
    const height = top + rows.length * rowH + axis;
    const x = (v) => left + Math.max(0, Math.min(1, v)) * width;
    const root = svg("svg", { viewBox: `0 0 ${left + width + right} ${height}`, class: "chart",
      role: "img", "aria-labelledby": "chart-title chart-desc" });
    const described = rows.map((r) => `${r.name} ${fmt(r.value)}` +
      (r.interval ? ` (95% interval ${fmt(r.interval[0])} to ${fmt(r.interval[1])})` : "")).join("; ");
    root.append(svg("title", { id: "chart-title" }, `Metrics of ${report.model_version} on ${report.query_set}`),
      svg("desc", { id: "chart-desc" }, described));
    for (const tick of [0, 0.25, 0.5, 0.75, 1]) {
      root.append(svg("line", { x1: x(tick), x2: x(tick), y1: top, y2: height - axis, class: "grid" }),
        svg("text", { x: x(tick), y: height - 6, class: "tick", "text-anchor": "middle" }, String(tick)));
    }
    rows.forEach((row, i) => {
      const y = top + i * rowH;
      const mid = y + rowH / 2;
      const group = svg("g", { class: "bar", "data-metric": row.key });
      group.append(svg("title", {}, row.name + " " + fmt(row.value) + (row.interval
        ? `, 95% interval [${fmt(row.interval[0])}, ${fmt(row.interval[1])}]` : "")));
      group.append(svg("text", { x: left - 8, y: mid + 4, "text-anchor": "end", class: "name" }, row.name));
      group.append(svg("rect", { x: left, y: y + 6, width: Math.max(0, x(row.value || 0) - left), height: rowH - 12, rx: 2 }));
      if (row.interval) {
        const [lo, hi] = row.interval.map(x);
        group.append(svg("line", { x1: lo, x2: hi, y1: mid, y2: mid, class: "whisker" }),
          svg("line", { x1: lo, x2: lo, y1: mid - 6, y2: mid + 6, class: "whisker" }),
          svg("line", { x1: hi, x2: hi, y1: mid - 6, y2: mid + 6, class: "whisker" }));
      }
      const label = row.interval ? `${fmt(row.value)} [${fmt(row.interval[0], 2)}, ${fmt(row.interval[1], 2)}]` : fmt(row.value);
      group.append(svg("text", { x: left + width + 8, y: mid + 4, class: "value" }, label));
      root.append(group);
    });
    return root;
  }

  function labelTable(perLabel) {
    if (perLabel.length === 0) return el("p", { cls: "muted", text: "no per-label breakdown in this report" });
    const head = el("tr", {}, ...["label", "queries", "MAP@R", "P@1", "retrieved instead (top R)"]
      .map((h) => el("th", { text: h, attrs: { scope: "col" } })));
    const body = el("tbody");
    for (const row of perLabel) {
      const confusions = (row.confusions || []).map((c) => `${c.label} ×${c.count}`).join(", ");
      body.append(el("tr", {},
        el("th", { text: row.label, attrs: { scope: "row" } }),
        el("td", { cls: "num", text: String(row.count) }),
        el("td", { cls: "num", text: fmt(row.map_at_r) }),
        el("td", { cls: "num", text: fmt(row.precision_at_1) }),
        el("td", { text: confusions || "—" })));
    }
    return el("div", { cls: "table-wrap" }, el("table", { cls: "per-label" }, el("thead", {}, head), body));
  }

  function thumb(src, alt, caption, cls) {
    return el("figure", { cls: `thumb ${cls}` },
      el("img", { attrs: { src, alt, loading: "lazy" } }),
      el("figcaption", { text: caption }));
  }

  function worstRows(report) {
    const worst = report.worst || [];
    if (worst.length === 0) return el("p", { cls: "muted", text: "no query to show" });
    const list = el("ol", { cls: "worst" });
    for (const query of worst) {
      const rank = query.first_relevant_rank === null ? "none relevant ranked" : `first relevant: rank ${query.first_relevant_rank}`;
      const src = query.query_id === null || query.query_id === undefined ? ""
        : imgret.scoped(`/query-sets/${encodeURIComponent(report.query_set)}/items/${encodeURIComponent(query.query_id)}/image`);
      const row = el("li", { cls: "worst-row" },
        thumb(src, `query ${query.query_id ?? query.index}, label ${query.label}`,
          `${query.label} · AP@R ${fmt(query.average_precision_at_r, 2)} · ${rank}`, "query"));
      const neighbours = el("div", { cls: "neighbours", attrs: { role: "list", "aria-label": "its top neighbours" } });
      query.neighbours.forEach((n, i) => {
        const figure = thumb(imgret.scoped(`/gallery/${encodeURIComponent(n.id)}/image`),
          `rank ${i + 1}: item ${n.id}, label ${n.label}, ${n.relevant ? "relevant" : "not relevant"}`,
          `${n.relevant ? "✓" : "✗"} ${n.label}`, n.relevant ? "relevant" : "irrelevant");
        figure.setAttribute("role", "listitem");
        figure.dataset.id = String(n.id);
        neighbours.append(figure);
      });
      row.append(neighbours);
      list.append(row);
    }
    return list;
  }

  imgret.register("evaluate", { show });
  imgret.evaluate = { chart, metricRows, svg };
})();

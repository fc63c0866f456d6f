// The open-set part of the Evaluate view (report.open_set, docs/evaluation.md): the DET curve
// (FNIR against FPIR on a log axis) with the operating points and their 95% intervals as
// error bars, TAR against FAR with its intervals, a table of the operating points, and a
// threshold slider over the DET thresholds that shows FPIR/FNIR there and the decision it
// would take on the hardest queries (report.open_set.hardest).
"use strict";

(() => {
  const { el, fmt } = imgret;
  const { svg } = imgret.evaluate;
  const W = 520, H = 300, PAD = { left: 52, right: 16, top: 12, bottom: 40 };

  /** A log10 x axis from the smallest positive rate shown (a decade below it) to 1. */
  function logAxis(rates) {
    const positive = rates.filter((r) => typeof r === "number" && r > 0);
    const low = positive.length ? Math.min(...positive) : 0.001;
    const lo = Math.floor(Math.log10(low)) - (low === 1 ? 1 : 0);
    const x = (rate) => {
      // A rate of 0 has no place on a log axis: it sits on the left edge.
      const v = rate > 0 ? Math.max(Math.log10(rate), lo) : lo;
      return PAD.left + ((v - lo) / -lo) * (W - PAD.left - PAD.right);
    };
    const ticks = [];
    for (let d = lo; d <= 0; d += 1) ticks.push(10 ** d);
    return { x, ticks };
  }

  const yOf = (v) => PAD.top + (1 - Math.max(0, Math.min(1, v))) * (H - PAD.top - PAD.bottom);

  function frame(id, title, desc, xName, yName, axis) {
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart plot", id,
      role: "img", "aria-labelledby": `${id}-title ${id}-desc` });
    root.append(svg("title", { id: `${id}-title` }, title), svg("desc", { id: `${id}-desc` }, desc));
    for (const tick of axis.ticks) {
      root.append(svg("line", { x1: axis.x(tick), x2: axis.x(tick), y1: PAD.top, y2: H - PAD.bottom, class: "grid" }),
        svg("text", { x: axis.x(tick), y: H - PAD.bottom + 14, class: "tick", "text-anchor": "middle" },
          tick >= 0.01 ? String(tick) : tick.toExponential(0)));
    }
    for (const tick of [0, 0.25, 0.5, 0.75, 1]) {
      root.append(svg("line", { x1: PAD.left, x2: W - PAD.right, y1: yOf(tick), y2: yOf(tick), class: "grid" }),
        svg("text", { x: PAD.left - 6, y: yOf(tick) + 4, class: "tick", "text-anchor": "end" }, String(tick)));
    }
    root.append(
      svg("text", { x: (PAD.left + W - PAD.right) / 2, y: H - 6, class: "name", "text-anchor": "middle" }, xName),
      svg("text", { x: 12, y: (PAD.top + H - PAD.bottom) / 2, class: "name", "text-anchor": "middle",
        transform: `rotate(-90 12 ${(PAD.top + H - PAD.bottom) / 2})` }, yName));
    return root;
  }

  /** A point with its interval bars: horizontal (x interval) and vertical (y interval). */
  function pointWithBars(cls, cx, cy, xInterval, yInterval, tip) {
    const group = svg("g", { class: cls });
    group.append(svg("title", {}, tip));
    if (xInterval) {
      const [a, b] = xInterval;
      group.append(svg("line", { x1: a, x2: b, y1: cy, y2: cy, class: "whisker" }),
        svg("line", { x1: a, x2: a, y1: cy - 4, y2: cy + 4, class: "whisker" }),
        svg("line", { x1: b, x2: b, y1: cy - 4, y2: cy + 4, class: "whisker" }));
    }
    if (yInterval) {
      const [a, b] = yInterval;
      group.append(svg("line", { x1: cx, x2: cx, y1: a, y2: b, class: "whisker" }),
        svg("line", { x1: cx - 4, x2: cx + 4, y1: a, y2: a, class: "whisker" }),
        svg("line", { x1: cx - 4, x2: cx + 4, y1: b, y2: b, class: "whisker" }));
    }
    group.append(svg("circle", { cx, cy, r: 4 }));
    return group;
  }

  const interval = (estimate) => (estimate && estimate.ci95 ? estimate.ci95 : null);
  const withInterval = (estimate, digits = 3) => (estimate
    ? fmt(estimate.value, digits) + (estimate.ci95
      ? ` [${fmt(estimate.ci95[0], digits)}, ${fmt(estimate.ci95[1], digits)}]` : "")
    : "–");

  function detChart(section, report) {
    const { det } = section;
    const points = section.operating_points.filter((p) => p.threshold);
    const axis = logAxis([...det.fpir, ...points.map((p) => p.fpir)]);
    const root = frame("det-chart", `DET curve of ${report.model_version} on ${report.query_set}`,
      `FNIR against FPIR over ${det.fpir.length} thresholds; ` + points.map((p) =>
        `at FPIR ${p.fpir}: FNIR ${withInterval(p.fnir)}`).join("; "),
      "FPIR (false alarms of unknown identities, log)", "FNIR (misses)", axis);
    // Through the DET points in threshold order (FPIR rises, FNIR falls as T drops).
    const path = det.fpir.map((f, i) => `${i ? "L" : "M"}${axis.x(f).toFixed(1)},${yOf(det.fnir[i]).toFixed(1)}`);
    root.append(svg("path", { d: path.join(" "), class: "curve det-line" }));
    for (const p of points) {
      const m = p.fpir_measured, n = p.fnir;
      root.append(pointWithBars("op-point", axis.x(m.value), yOf(n.value),
        interval(m) && interval(m).map(axis.x), interval(n) && interval(n).map(yOf),
        `target FPIR ${p.fpir}: threshold ${withInterval(p.threshold, 4)}, FPIR ${withInterval(m)}, FNIR ${withInterval(n)}`));
    }
    const marker = svg("circle", { r: 6, class: "det-marker", cx: -10, cy: -10 });
    root.append(marker);
    return { root, marker, axis };
  }

  function tarChart(section, report) {
    const shown = ((section.verification || {}).points || []).filter((p) => p.tar);
    if (!shown.length) return el("p", { cls: "muted", text: "no TAR@FAR point could be resolved (too few different-label pairs)" });
    const axis = logAxis(shown.map((p) => p.far));
    const root = frame("tar-chart", `TAR against FAR of ${report.model_version} on ${report.query_set}`,
      shown.map((p) => `TAR@FAR ${p.far}: ${withInterval(p.tar)}`).join("; "),
      `FAR (different-label pairs accepted, log; ${section.pairs} pairs)`, "TAR (same-label pairs accepted)", axis);
    root.append(svg("path", { class: "curve", d: shown.map((p, i) =>
      `${i ? "L" : "M"}${axis.x(p.far).toFixed(1)},${yOf(p.tar.value).toFixed(1)}`).join(" ") }));
    for (const p of shown) {
      root.append(pointWithBars("tar-point", axis.x(p.far), yOf(p.tar.value), null,
        interval(p.tar) && interval(p.tar).map(yOf), `TAR@FAR ${p.far}: ${withInterval(p.tar)}`));
    }
    return root;
  }

  function pointTable(section) {
    const tars = new Map(((section.verification || {}).points || []).map((p) => [p.far, p]));
    const head = el("tr", {}, ...["target FPIR", "threshold", "FNIR", "rank-1 identification",
      "FPIR measured", "TAR@FAR", "note"].map((h) => el("th", { text: h, attrs: { scope: "col" } })));
    const body = el("tbody");
    for (const p of section.operating_points) {
      const tar = tars.get(p.fpir);
      const row = el("tr", {},
        el("th", { text: String(p.fpir), attrs: { scope: "row" } }),
        el("td", { cls: "num", text: withInterval(p.threshold, 4) }),
        el("td", { cls: "num", text: withInterval(p.fnir) }),
        el("td", { cls: "num", text: withInterval(p.rank1_identification) }),
        el("td", { cls: "num", text: withInterval(p.fpir_measured) }),
        el("td", { cls: "num", text: tar ? withInterval(tar.tar) : "–" }),
        el("td", { cls: "muted", text: [p.note, tar && tar.note].filter(Boolean).join("; ") || "" }));
      row.dataset.fpir = String(p.fpir);
      body.append(row);
    }
    return el("div", { cls: "table-wrap" }, el("table", { cls: "op-table" }, el("thead", {}, head), body));
  }

  /** The decision at threshold ``t`` (null: above every score) on one hard query. */
  function decision(query, mated, t) {
    const accepted = t !== null && query.top_score !== null && query.top_score >= t;
    if (!mated) return accepted ? { text: `names ${query.top_label}`, outcome: "false alarm", ok: false }
      : { text: "unknown", outcome: "correct rejection", ok: true };
    if (!accepted) return { text: "unknown", outcome: "miss", ok: false };
    return query.top_label === query.label ? { text: `names ${query.top_label}`, outcome: "named right", ok: true }
      : { text: `names ${query.top_label}`, outcome: "wrong identity", ok: false };
  }

  function hardTable(section, report) {
    const hardest = section.hardest || { non_mated: [], mated: [] };
    const rows = [...hardest.non_mated.map((q) => ({ q, mated: false })),
      ...hardest.mated.map((q) => ({ q, mated: true }))];
    const head = el("tr", {}, ...["query", "kind", "label", "top candidate", "mate score", "decision", "outcome"]
      .map((h) => el("th", { text: h, attrs: { scope: "col" } })));
    const body = el("tbody");
    const cells = rows.map(({ q, mated }) => {
      const picture = q.query_id === null || report.query_set === null ? el("span", { text: `#${q.index}` })
        : el("img", { cls: "mini", attrs: { alt: `query ${q.query_id}, label ${q.label}`, loading: "lazy",
          src: imgret.scoped(`/query-sets/${encodeURIComponent(report.query_set)}/items/${encodeURIComponent(q.query_id)}/image`) } });
      const decided = el("td"), outcome = el("td");
      const row = el("tr", {}, el("td", {}, picture),
        el("td", { text: mated ? "mated" : "non-mated" }),
        el("td", { text: q.label }),
        el("td", { text: q.top_label === null ? "–" : `${q.top_label} · ${fmt(q.top_score, 4)}` }),
        el("td", { cls: "num", text: mated ? fmt(q.mate_score, 4) : "–" }),
        decided, outcome);
      row.dataset.kind = mated ? "mated" : "non-mated";
      body.append(row);
      return { q, mated, decided, outcome };
    });
    const table = rows.length
      ? el("div", { cls: "table-wrap" }, el("table", { cls: "decision-table" }, el("thead", {}, head), body))
      : el("p", { cls: "muted", text: "this report lists no hard queries" });
    return { table, update(t) {
      let alarms = 0, misses = 0;
      for (const c of cells) {
        const d = decision(c.q, c.mated, t);
        c.decided.textContent = d.text;
        c.outcome.textContent = d.outcome;
        c.outcome.className = `badge ${d.ok ? "verdict-better" : "verdict-worse"}`;
        if (!c.mated && !d.ok) alarms += 1;
        if (c.mated && !d.ok) misses += 1;
      }
      return { alarms, misses, nonMated: hardest.non_mated.length, mated: hardest.mated.length };
    } };
  }

  /** The slider over the DET thresholds, its read-out, and what it updates. */
  function slider(section, det, hard) {
    const { threshold, fpir, fnir } = det.source;
    const input = el("input", { attrs: { type: "range", id: "threshold-slider", min: "0",
      max: String(threshold.length - 1), step: "1", "aria-describedby": "threshold-readout" } });
    const readout = el("output", { cls: "readout", attrs: { id: "threshold-readout", for: "threshold-slider" } });
    // Start at the first resolved operating point (the DET threshold nearest to it).
    const first = section.operating_points.find((p) => p.threshold);
    let start = Math.floor(threshold.length / 2);
    if (first) {
      let best = Infinity;
      threshold.forEach((t, i) => {
        const gap = t === null ? Infinity : Math.abs(t - first.threshold.value);
        if (gap < best) { best = gap; start = i; }
      });
    }
    input.value = String(start);
    const update = () => {
      const i = Number(input.value);
      const t = threshold[i];
      det.marker.setAttribute("cx", det.axis.x(fpir[i]));
      det.marker.setAttribute("cy", yOf(fnir[i]));
      const counts = hard.update(t);
      readout.textContent = `threshold ${t === null ? "above every score" : fmt(t, 4)} · ` +
        `FPIR ${fmt(fpir[i])} · FNIR ${fmt(fnir[i])} · on the hardest queries: ` +
        `${counts.alarms} of ${counts.nonMated} unknown identities accepted, ` +
        `${counts.misses} of ${counts.mated} enrolled ones missed or misnamed`;
      readout.dataset.fpir = String(fpir[i]);
      readout.dataset.fnir = String(fnir[i]);
    };
    input.addEventListener("input", update);
    return { node: el("div", { cls: "toolbar threshold-bar" },
      el("label", { text: "threshold", attrs: { for: "threshold-slider" } }), input, readout), update };
  }

  function render(report) {
    const section = report.open_set;
    if (!section) return [];
    const det = detChart(section, report);
    det.source = section.det;
    const hard = hardTable(section, report);
    const control = slider(section, det, hard);
    control.update();
    return [el("section", { cls: "open-set", attrs: { id: "open-set", "aria-labelledby": "open-set-heading" } },
      el("h3", { text: "Open-set decisions: who is this, or nobody", attrs: { id: "open-set-heading" } }),
      el("p", { cls: "muted", text: `${section.mated} mated queries (identity in the gallery), ` +
        `${section.non_mated} non-mated (unknown identities) · ${section.resamples} bootstrap resamples ` +
        `of identities · intervals: 95% · ${section.note}` }),
      el("div", { cls: "plots" }, det.root, tarChart(section, report)),
      pointTable(section),
      el("h4", { text: "At a threshold: the decision on the hardest queries" }),
      control.node,
      hard.table)];
  }

  imgret.openSet = { render, decision };
})();

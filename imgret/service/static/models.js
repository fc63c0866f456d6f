// Models view: the registered versions (GET /models) with coverage, index and re-embedding
// state, the runtime this server runs it with, and the decision threshold each serves (its calibration); Embed / Activate (optionally gated on a paired comparison) / Roll back; Compare two
// versions on a query set. Polls GET /models every 2 s while a re-embedding runs.
"use strict";

(() => {
  const { api, statusSetter, el, fmt, fillSelect } = imgret;
  const tbody = document.querySelector("#models-table tbody");
  const setStatus = statusSetter(document.getElementById("models-status"));
  const setCompareStatus = statusSetter(document.getElementById("compare-status"));
  const requireSelect = document.getElementById("gate-require");
  const gateSetSelect = document.getElementById("gate-query-set");
  const rollbackButton = document.getElementById("rollback-button");
  const compareForm = document.getElementById("compare-form");
  const compareA = document.getElementById("compare-a");
  const compareB = document.getElementById("compare-b");
  const compareSet = document.getElementById("compare-query-set");
  const compareButton = document.getElementById("compare-button");
  const compareResult = document.getElementById("compare-result");
  const POLL_MS = 2000;

  let visible = false;
  let timer = null;

  function stopPolling() {
    if (timer !== null) clearTimeout(timer);
    timer = null;
  }

  async function load() {
    stopPolling();
    let listing;
    try {
      listing = await imgret.models();
    } catch (err) {
      setStatus(`could not list the models: ${err.message}`, true);
      return;
    }
    renderTable(listing);
    const versions = listing.models.map((m) => m.version);
    const others = versions.filter((v) => v !== listing.active);
    fillSelect(compareA, versions, { selected: listing.active });
    fillSelect(compareB, versions, { selected: others[0] });
    if (visible && listing.models.some((m) => m.embedding.state === "running")) {
      timer = setTimeout(load, POLL_MS);
    }
  }

  async function loadQuerySets() {
    try {
      const names = (await imgret.querySets()).map((s) => s.name);
      fillSelect(gateSetSelect, names, { selected: names[0] });
      fillSelect(compareSet, names, { selected: names[0] });
      compareButton.disabled = names.length === 0;
    } catch (err) {
      setCompareStatus(`could not list the query sets: ${err.message}`, true);
    }
  }

  function created(iso) {
    return iso ? iso.slice(0, 16).replace("T", " ") : "–";
  }

  function coverageCell(coverage) {
    const { embedded, live } = coverage;
    const percent = live > 0 ? Math.floor((100 * embedded) / live) : 100;
    const bar = el("progress", { attrs: { max: String(Math.max(live, 1)), value: String(live > 0 ? embedded : 1),
      "aria-label": `${embedded} of ${live} live items embedded` } });
    return el("td", { cls: "coverage" }, bar, el("span", { cls: "coverage-text", text: `${embedded} / ${live} (${percent}%)` }));
  }

  /** The decision threshold the version serves (its newest calibration), or why none. */
  function calibrationCell(m) {
    const c = m.calibration;
    if (!c) {
      return el("td", { cls: "calibration muted", text: "not calibrated: serves no decisions",
        attrs: { title: m.decisions || "" } });
    }
    const ci = c.threshold_ci95 ? ` [${fmt(c.threshold_ci95[0], 4)}, ${fmt(c.threshold_ci95[1], 4)}]` : "";
    const fnir = (c.details || {}).fnir;
    const fnirText = fnir && fnir.ci95 ? `${fmt(c.fnir)} [${fmt(fnir.ci95[0])}, ${fmt(fnir.ci95[1])}]` : fmt(c.fnir);
    const option = c.rerank ? ` · re-ranked (${c.rerank.method})` : "";
    const cell = el("td", { cls: "calibration", attrs: { title: m.decisions || "" } },
      el("div", { cls: "num", text: `threshold ${fmt(c.threshold, 4)}${ci}` }),
      el("div", { cls: "muted small", text: `target FPIR ${c.target_fpir} · measured FPIR ${fmt(c.fpir)} · FNIR ${fnirText}` }),
      el("div", { cls: "muted small", text: `on ${c.query_set} · ${created(c.created_at)}${option}` }));
    cell.dataset.threshold = String(c.threshold);
    return cell;
  }

  /** The model and how this server runs its network (GET /models' runtime), or that it has
   * not loaded it. */
  function modelCell(m) {
    const r = m.runtime;
    const diff = r && r.max_abs_diff != null ? ` · Δ ${r.max_abs_diff.toExponential(1)}` : "";
    const runtime = r ? `${r.runtime}${diff}` : "not loaded here";
    const title = r
      ? `${r.reason} (IMGRET_RUNTIME=${r.asked})${diff ? `; largest difference from torch on the version's sample: ${r.max_abs_diff.toExponential(1)} (bound ${r.bound})` : ""}`
      : "this server has not loaded the version: its runtime is chosen when it does";
    return el("td", {}, el("div", { text: `${m.config.backbone ?? "?"} · ${m.dim}-d` }),
      el("div", { cls: "muted small runtime", text: runtime, attrs: { title } }));
  }

  function renderTable(listing) {
    tbody.replaceChildren();
    if (listing.models.length === 0) {
      tbody.append(el("tr", {}, el("td", { text: "no model version is registered", attrs: { colspan: "9" } })));
    }
    for (const m of listing.models) {
      const versionCell = el("th", { attrs: { scope: "row" } }, el("code", { text: m.version }));
      if (m.active) versionCell.append(" ", el("span", { cls: "badge active-badge", text: "active" }));
      const index = m.index.state === "built"
        ? `built · ${m.index.size ?? "?"} · ${m.index.factory ?? ""}` : "missing";
      const job = el("td", { cls: `job job-${m.embedding.state}`, text: m.embedding.state });
      if (m.embedding.error) job.append(el("div", { cls: "error-text", text: m.embedding.error }));
      const evaluation = m.last_evaluation;
      const last = el("td", { cls: "num" }, fmt(evaluation ? evaluation.map_at_r : null));
      if (evaluation) last.append(el("div", { cls: "muted small", text: `on ${evaluation.query_set}` }));

      const embed = el("button", { text: "Embed", attrs: { type: "button", "aria-label": `Embed the gallery with ${m.version}` } });
      embed.disabled = m.embedding.state === "running" || !m.checkpoint_stored;
      embed.addEventListener("click", () => embedVersion(m.version));
      const activate = el("button", { text: "Activate", attrs: { type: "button", "aria-label": `Activate ${m.version}` } });
      activate.disabled = m.active;
      activate.addEventListener("click", () => activateVersion(m.version));

      const row = el("tr", { cls: m.active ? "active-row" : "" },
        versionCell,
        modelCell(m),
        el("td", { text: created(m.created_at) }),
        coverageCell(m.coverage),
        el("td", { text: index }),
        job,
        last,
        calibrationCell(m),
        el("td", { cls: "actions" }, embed, activate));
      row.dataset.version = m.version;
      tbody.append(row);
    }
  }

  async function embedVersion(version) {
    setStatus(`starting the re-embedding for ${version}…`);
    const answer = await api(`/models/${encodeURIComponent(version)}/embed`, { method: "POST" });
    if (!answer.ok) {
      setStatus(answer.error, true);
      return;
    }
    setStatus(`re-embedding the gallery for ${version} (${answer.body.embedding.state})`);
    await load();
  }

  async function activateVersion(version) {
    const require = requireSelect.value;
    let json;
    if (require) {
      if (!gateSetSelect.value) {
        setStatus("a gated activation needs a query set to compare on", true);
        return;
      }
      json = { require, query_set: gateSetSelect.value };
    }
    setStatus(require ? `comparing ${version} with the active version on ${json.query_set}…` : `activating ${version}…`);
    const answer = await api(`/models/${encodeURIComponent(version)}/activate`, { method: "POST", json });
    const comparison = answer.body && answer.body.comparison;
    if (comparison) showComparison(comparison, json.query_set);
    if (!answer.ok) {
      setStatus(`refused: ${answer.error}`, true);
      return;
    }
    const body = answer.body;
    setStatus(body.changed === false ? `${body.active} was already active`
      : `active: ${body.active}${body.previous ? ` (was ${body.previous})` : ""}`);
    imgret.loadHealth();
    await load();
  }

  rollbackButton.addEventListener("click", async () => {
    setStatus("rolling back…");
    const answer = await api("/models/rollback", { method: "POST" });
    if (!answer.ok) {
      setStatus(`refused: ${answer.error}`, true);
      return;
    }
    setStatus(`rolled back: active ${answer.body.active} (was ${answer.body.previous})`);
    imgret.loadHealth();
    await load();
  });

  compareForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    const [a, b, querySet] = [compareA.value, compareB.value, compareSet.value];
    if (!a || !b || a === b) {
      setCompareStatus("pick two different versions", true);
      return;
    }
    setCompareStatus(`comparing ${b} with ${a} on ${querySet}…`);
    compareButton.disabled = true;
    try {
      const answer = await api("/evaluate", { method: "POST", json: { query_set: querySet, compare: [a, b] } });
      if (!answer.ok) {
        setCompareStatus(answer.error, true);
        return;
      }
      showComparison(answer.body, querySet);
      const v = answer.body.verdict || {};
      setCompareStatus(`B vs A on MAP@R: ${v.map_at_r ?? "?"}`);
      await load(); // the evaluations update "last MAP@R"
    } catch (err) {
      setCompareStatus(`request failed: ${err}`, true);
    } finally {
      compareButton.disabled = false;
    }
  });

  const NAMES = { map_at_r: "MAP@R", mean_average_precision: "mAP", precision_at_1: "P@1",
    mrr: "MRR", r_precision: "R-Precision" };

  function verdictClass(verdict) {
    return verdict === "better" ? "verdict-better" : verdict === "worse" ? "verdict-worse" : "verdict-none";
  }

  /** The CompareResult of POST /evaluate {compare} (or of a gated activation) as a table. */
  function showComparison(result, querySet) {
    const a = result.a.model_version, b = result.b.model_version;
    const rows = Object.entries(result.difference || {});
    const paired = rows.length ? rows[0][1].num_paired : 0;
    const head = el("tr", {}, ...["metric", "A", "B", "B − A", "95% interval", "verdict (B vs A)"]
      .map((h) => el("th", { text: h, attrs: { scope: "col" } })));
    const body = el("tbody");
    for (const [metric, d] of rows) {
      const signed = (v) => (v >= 0 ? "+" : "") + fmt(v, 4);
      const row = el("tr", {},
        el("th", { text: NAMES[metric] || metric, attrs: { scope: "row" } }),
        el("td", { cls: "num", text: fmt(d.a) }),
        el("td", { cls: "num", text: fmt(d.b) }),
        el("td", { cls: "num", text: signed(d.difference) }),
        el("td", { cls: "num", text: `[${signed(d.ci95[0])}, ${signed(d.ci95[1])}]` }),
        el("td", {}, el("span", { cls: `badge ${verdictClass(d.verdict)}`, text: d.verdict })));
      row.dataset.metric = metric;
      body.append(row);
    }
    compareResult.replaceChildren(
      el("p", { cls: "muted" }, "A = ", el("code", { text: a }), " · B = ", el("code", { text: b }),
        ` · ${querySet || result.a.query_set} · ${paired} paired queries · "better": the whole interval of B − A lies above 0`),
      el("div", { cls: "table-wrap" }, el("table", { cls: "comparison" }, el("thead", {}, head), body)));
  }

  requireSelect.addEventListener("change", () => {
    gateSetSelect.disabled = !requireSelect.value;
  });
  gateSetSelect.disabled = !requireSelect.value;

  imgret.register("models", {
    show() {
      visible = true;
      loadQuerySets();
      load();
    },
    hide() {
      visible = false;
      stopPolling();
    },
  });
})();

// Identities view: the gallery grouped by label (GET /identities, a few images of each),
// merging two labels and erasing one (with its receipt); the clusters of unknowns to name
// (enroll) or dismiss (GET /identities/unknowns, needs a key with write); the audit log with
// an Undo per change that can be undone.
"use strict";

(() => {
  const { api, statusSetter, el, fmt, fillSelect } = imgret;
  const setStatus = statusSetter(document.getElementById("identities-status"));
  const setUnknownsStatus = statusSetter(document.getElementById("unknowns-status"));
  const grid = document.getElementById("identity-grid");
  const clustersBox = document.getElementById("clusters");
  const auditBody = document.querySelector("#audit-table tbody");
  const mergeForm = document.getElementById("merge-form");
  const mergeSource = document.getElementById("merge-source");
  const mergeTarget = document.getElementById("merge-target");
  const labelList = document.getElementById("identity-labels");
  const eraseSelect = document.getElementById("erase-label");
  const eraseButton = document.getElementById("erase-button");
  const receiptBox = document.getElementById("receipt");
  const PER_LABEL = 4;
  const blobUrls = [];

  /** An image behind the API key (the unknowns need one even on a public collection): fetched
   *  with the header, shown from a blob URL that is released at the next render. */
  async function keyedImage(path, alt) {
    const img = el("img", { attrs: { alt, loading: "lazy" } });
    const headers = {};
    const key = document.getElementById("api-key").value.trim();
    if (key) headers["X-API-Key"] = key;
    try {
      const response = await fetch(path, { headers });
      if (response.ok) {
        const url = URL.createObjectURL(await response.blob());
        blobUrls.push(url);
        img.src = url;
      }
    } catch (_) {
      // left blank: the status line says why when the listing itself failed
    }
    return img;
  }

  function releaseImages() {
    while (blobUrls.length) URL.revokeObjectURL(blobUrls.pop());
  }

  async function loadIdentities() {
    const answer = await api("/identities?limit=200");
    if (!answer.ok) {
      setStatus(`could not list the identities: ${answer.error}`, true);
      return;
    }
    const labels = answer.body.data.map((row) => row.label);
    fillSelect(mergeSource, labels, { selected: labels[0] });
    fillSelect(eraseSelect, labels, { selected: labels[0] });
    labelList.replaceChildren(...labels.map((label) => el("option", { attrs: { value: label } })));
    const cards = [];
    for (const row of answer.body.data) {
      const items = await api(`/gallery?label=${encodeURIComponent(row.label)}&limit=${PER_LABEL}`);
      const thumbs = (items.ok ? items.body.data : []).map((item) =>
        el("img", { attrs: { src: item.uri, alt: `item ${item.id}`, loading: "lazy" } }));
      const card = el("figure", { cls: "identity" },
        el("div", { cls: "strip" }, ...thumbs),
        el("figcaption", {}, el("strong", { cls: "label", text: row.label }),
          ` · ${row.items} image${row.items === 1 ? "" : "s"}`));
      card.dataset.label = row.label;
      cards.push(card);
    }
    grid.replaceChildren(...cards);
    setStatus(`${answer.body.count} identit${answer.body.count === 1 ? "y" : "ies"}`);
  }

  async function loadClusters() {
    const answer = await api("/identities/unknowns?limit=50");
    if (!answer.ok) {
      clustersBox.replaceChildren();
      setUnknownsStatus(answer.status === 401 || answer.status === 403
        ? "the unknowns need a key with write on this collection" : answer.error, true);
      return;
    }
    if (!answer.body.count) {
      clustersBox.replaceChildren();
      setUnknownsStatus("no unknowns kept (PATCH /collections/{name} {\"unknowns_days\": N} keeps them)");
      return;
    }
    const cards = [];
    for (const cluster of answer.body.data) {
      const images = await Promise.all(cluster.members.map((m) =>
        keyedImage(m.uri, `unknown ${m.id}`)));
      const name = el("input", { attrs: { type: "text", placeholder: "name", "aria-label": `name for cluster ${cluster.id}` } });
      const enroll = el("button", { text: "Enroll", attrs: { type: "button" } });
      const dismiss = el("button", { text: "Dismiss", attrs: { type: "button" } });
      enroll.addEventListener("click", () => act(
        `/identities/unknowns/clusters/${cluster.id}/enroll`, { label: name.value.trim() },
        `cluster ${cluster.id} enrolled`));
      dismiss.addEventListener("click", () => act(
        `/identities/unknowns/clusters/${cluster.id}/dismiss`, undefined,
        `cluster ${cluster.id} dismissed`));
      const card = el("figure", { cls: "cluster" },
        el("div", { cls: "strip" }, ...images),
        el("figcaption", {},
          `${cluster.size} sighting${cluster.size === 1 ? "" : "s"} · cohesion ${fmt(cluster.cohesion, 2)}`,
          el("span", { cls: "cluster-actions" }, name, enroll, dismiss)));
      card.dataset.cluster = String(cluster.id);
      cards.push(card);
    }
    clustersBox.replaceChildren(...cards);
    setUnknownsStatus(`${answer.body.count} cluster${answer.body.count === 1 ? "" : "s"}, largest first`);
  }

  async function loadAudit() {
    const answer = await api("/identities/changes?limit=50");
    if (!answer.ok) {
      setStatus(`could not read the audit log: ${answer.error}`, true);
      return;
    }
    const rows = answer.body.data.map((change) => {
      const undoable = ["merge", "move", "undo"].includes(change.action) && change.undone_by === null;
      const cell = el("td");
      if (undoable) {
        const button = el("button", { text: "Undo", attrs: { type: "button" } });
        button.addEventListener("click", () => act(`/identities/changes/${change.id}/undo`,
          undefined, `change ${change.id} undone`));
        cell.append(button);
      } else if (change.undone_by !== null) {
        cell.append(el("span", { cls: "muted", text: `undone by #${change.undone_by}` }));
      }
      const row = el("tr", {},
        el("td", { cls: "num", text: String(change.id) }),
        el("td", { text: new Date(change.created_at).toLocaleString() }),
        el("td", { text: change.action }),
        el("td", { text: change.from_label ?? "–" }),
        el("td", { text: change.to_label ?? "–" }),
        el("td", { cls: "num", text: String(change.moves.length) }),
        el("td", { text: change.actor }),
        cell);
      row.dataset.change = String(change.id);
      row.dataset.action = change.action;
      return row;
    });
    auditBody.replaceChildren(...rows);
  }

  async function act(path, json, done) {
    const answer = await api(path, { method: "POST", json: json ?? {} });
    if (!answer.ok) {
      setStatus(answer.error, true);
      return null;
    }
    setStatus(done);
    await refresh();
    return answer.body;
  }

  function showReceipt(receipt) {
    const lines = [
      ["gallery items", `${receipt.gallery_items.count} (ids ${receipt.gallery_item_ids.join(", ") || "none"})`],
      ["vectors", String(receipt.vectors)],
      ["query-set items", String(receipt.query_items.count)],
      ["images removed", String(receipt.media_removed)],
      ["audit entries cleared", String(receipt.audit_entries_cleared)],
      ["committed", new Date(receipt.committed_at).toLocaleString()],
      ["confirmed by", receipt.confirmed.map((c) => `${c.process} at ${new Date(c.confirmed_at).toLocaleTimeString()}`).join("; ") || "–"],
      ["not confirmed", receipt.unconfirmed.join("; ") || "none"],
      ["image SHA-256", receipt.gallery_items.sha256.join(" ") || "–"],
    ];
    receiptBox.replaceChildren(
      el("h4", { text: `Erased: ${receipt.label}` }),
      el("dl", {}, ...lines.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])));
    receiptBox.hidden = false;
  }

  mergeForm.addEventListener("submit", (event) => {
    event.preventDefault();
    act("/identities/merge", { source: mergeSource.value, target: mergeTarget.value.trim() },
      `${mergeSource.value} merged into ${mergeTarget.value.trim()}`);
  });

  eraseButton.addEventListener("click", async () => {
    const label = eraseSelect.value;
    if (!label || !window.confirm(`Erase everything of ${label}? This cannot be undone.`)) return;
    const receipt = await act("/identities/erase", { label }, `${label} erased`);
    if (receipt) showReceipt(receipt);
  });

  async function refresh() {
    releaseImages();
    await Promise.all([loadIdentities(), loadClusters(), loadAudit()]);
  }

  imgret.register("identities", {
    show() {
      receiptBox.hidden = true;
      refresh();
    },
    hide() {
      releaseImages();
    },
  });
})();

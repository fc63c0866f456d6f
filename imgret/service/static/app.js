// imgret web page: three views behind a hash router (#search, #evaluate, #models).
// This file holds what they share (the API key field, fetch helpers, small DOM helpers, the
// router) and the Search view: choose or drop an image, POST it to /search, show the
// neighbours as a grid; clicking a neighbour searches by its stored item id.
// evaluate.js and models.js add the other views. Plain JS, no build step, nothing fetched
// from anywhere but this server.
"use strict";

const imgret = (() => {
  const keyInput = document.getElementById("api-key");
  const KEY_STORE = "imgret.apiKey";
  try {
    keyInput.value = sessionStorage.getItem(KEY_STORE) || "";
  } catch (_) {
    // storage disabled: the field still works for this page
  }
  keyInput.addEventListener("change", () => {
    try {
      sessionStorage.setItem(KEY_STORE, keyInput.value);
    } catch (_) {
      // ignore
    }
  });

  function detailText(body, response) {
    // FastAPI errors are {"detail": "..."} or {"detail": [{msg, loc}, ...]} for validation.
    if (body && typeof body.detail === "string") return body.detail;
    if (body && Array.isArray(body.detail)) return body.detail.map((d) => d.msg).join("; ");
    return `${response.status} ${response.statusText}`;
  }

  // The collection picker: the routes of a collection other than "default" are the same ones
  // under /collections/{name}; the choice is kept for this tab like the key.
  const collectionSelect = document.getElementById("collection");
  const COLLECTION_STORE = "imgret.collection";
  const GLOBAL_ROUTES = ["/collections", "/keys", "/health", "/admin", "/metrics"];
  let collection = "default";
  try {
    collection = sessionStorage.getItem(COLLECTION_STORE) || "default";
  } catch (_) {
    // storage disabled
  }

  function scoped(path) {
    if (collection === "default" || GLOBAL_ROUTES.some((r) => path.startsWith(r))) return path;
    return `/collections/${encodeURIComponent(collection)}${path}`;
  }

  /** fetch() with the API key header (when given) and a JSON or form body, on the chosen
   *  collection's routes. Resolves to {ok, status, body, error}: error is the API's message
   *  when not ok. */
  async function api(path, { method = "GET", json, form } = {}) {
    const headers = {};
    const key = keyInput.value.trim();
    // Reads of a private collection need the key too.
    if (key) headers["X-API-Key"] = key;
    path = scoped(path);
    let body;
    if (json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(json);
    } else if (form !== undefined) {
      body = form;
    }
    const response = await fetch(path, { method, headers, body });
    let parsed = null;
    try {
      parsed = await response.json();
    } catch (_) {
      // not JSON
    }
    let error = null;
    if (!response.ok) {
      error = detailText(parsed, response);
      if (response.status === 401) error += " (enter the API key at the top of the page)";
    }
    return { ok: response.ok, status: response.status, body: parsed, error };
  }

  function statusSetter(element) {
    return (text, isError = false) => {
      element.textContent = text;
      element.classList.toggle("error", isError);
    };
  }

  /** document.createElement with a class, text and children; text is never parsed as HTML. */
  function el(tag, { cls, text, attrs } = {}, ...children) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    node.append(...children);
    return node;
  }

  function fmt(value, digits = 3) {
    return typeof value === "number" && Number.isFinite(value) ? value.toFixed(digits) : "–";
  }

  function fillSelect(select, values, { selected, empty } = {}) {
    const before = select.value;
    select.replaceChildren();
    if (empty !== undefined) select.append(el("option", { text: empty, attrs: { value: "" } }));
    for (const value of values) {
      const option = typeof value === "string" ? { value, text: value } : value;
      select.append(el("option", { text: option.text, attrs: { value: option.value } }));
    }
    const wanted = values.some((v) => (v.value ?? v) === before) ? before : selected;
    if (wanted !== undefined && wanted !== null) select.value = wanted;
  }

  async function querySets() {
    const answer = await api("/query-sets");
    if (!answer.ok) throw new Error(answer.error);
    return answer.body.query_sets;
  }

  async function models() {
    const answer = await api("/models");
    if (!answer.ok) throw new Error(answer.error);
    return answer.body;
  }

  const health = document.getElementById("health");

  async function loadHealth() {
    try {
      const response = await fetch("/health");
      const body = await response.json();
      if (collection === "default") {
        health.textContent = `${body.index_size} images indexed · model ${body.model_version} · ${body.device}`;
        return;
      }
      const answer = await api(`/collections/${encodeURIComponent(collection)}`);
      health.textContent = answer.ok
        ? `${answer.body.items} images in ${collection} · model ${answer.body.active_version} · ${body.device}`
        : answer.error;
    } catch (err) {
      health.textContent = "service unreachable";
    }
  }

  async function loadCollections() {
    const answer = await api("/collections");
    const names = answer.ok ? answer.body.collections.map((c) => c.name) : ["default"];
    if (!names.includes(collection)) names.push(collection);
    fillSelect(collectionSelect, names, { selected: collection });
  }

  collectionSelect.addEventListener("change", () => {
    collection = collectionSelect.value || "default";
    try {
      sessionStorage.setItem(COLLECTION_STORE, collection);
    } catch (_) {
      // ignore
    }
    loadHealth();
    // The open view reads its data again from the chosen collection.
    if (current && views[current] && views[current].show) views[current].show();
  });
  keyInput.addEventListener("change", () => {
    loadCollections();
    // What the open view shows may depend on the key (a private collection, the unknowns).
    if (current && views[current] && views[current].show) views[current].show();
  });

  // Router: one view visible at a time; a view may register show()/hide() hooks.
  const views = {};
  function register(name, hooks) {
    views[name] = hooks;
  }
  let current = null;
  function route() {
    const name = (location.hash || "#search").slice(1);
    const target = document.getElementById(`view-${name}`) ? name : "search";
    if (target === current) return;
    if (current && views[current] && views[current].hide) views[current].hide();
    for (const section of document.querySelectorAll("main > .view")) {
      section.hidden = section.id !== `view-${target}`;
    }
    for (const link of document.querySelectorAll("nav a[data-view]")) {
      if (link.dataset.view === target) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    current = target;
    if (views[target] && views[target].show) views[target].show();
  }
  window.addEventListener("hashchange", route);

  return { api, scoped, statusSetter, el, fmt, fillSelect, querySets, models, loadHealth,
           loadCollections, register, route };
})();

// ---------------------------------------------------------------------------- Search view
(() => {
  const { api, statusSetter, el } = imgret;
  const fileInput = document.getElementById("file-input");
  const dropZone = document.getElementById("drop-zone");
  const preview = document.getElementById("query-preview");
  const hint = document.getElementById("drop-hint");
  const kInput = document.getElementById("k-input");
  const labelInput = document.getElementById("label-input");
  const results = document.getElementById("results");
  const setStatus = statusSetter(document.getElementById("status"));

  let previewUrl = null;

  function showPreview(source, alt) {
    if (previewUrl) URL.revokeObjectURL(previewUrl);
    previewUrl = null;
    if (typeof source === "string") {
      preview.src = source;
    } else {
      previewUrl = URL.createObjectURL(source);
      preview.src = previewUrl;
    }
    preview.alt = alt;
    preview.hidden = false;
    hint.textContent = "Drop or click to search with another image";
  }

  function searchForm() {
    const form = new FormData();
    form.append("k", String(Math.min(1000, Math.max(1, Number(kInput.value) || 12))));
    const label = labelInput.value.trim();
    if (label) form.append("label", label);
    return form;
  }

  async function run(form, what) {
    setStatus("searching…");
    results.setAttribute("aria-busy", "true");
    try {
      const answer = await api("/search", { method: "POST", form });
      if (!answer.ok) {
        setStatus(answer.error, true);
        return;
      }
      const body = answer.body;
      render(body.results);
      setStatus(`${body.results.length} neighbours${what} in ${body.took_ms.toFixed(1)} ms · model ${body.model_version}`);
    } catch (err) {
      setStatus(`request failed: ${err}`, true);
    } finally {
      results.removeAttribute("aria-busy");
    }
  }

  function searchImage(blob, name) {
    showPreview(blob, "query image");
    const form = searchForm();
    form.append("image", blob, name || "query");
    return run(form, "");
  }

  /** Search with a stored gallery item (its stored vector; the item itself is left out). */
  function searchById(id) {
    showPreview(imgret.scoped(`/gallery/${encodeURIComponent(id)}/image`), `query: item ${id}`);
    const form = searchForm();
    form.append("id", String(id));
    return run(form, ` of item #${id}`);
  }

  function render(hits) {
    results.replaceChildren();
    for (const hit of hits) {
      const card = el("button", { cls: "result", attrs: { type: "button", title: `search with item ${hit.id}` } });
      card.dataset.id = String(hit.id);
      const img = el("img", { attrs: { src: imgret.scoped(`/gallery/${encodeURIComponent(hit.id)}/image`), alt: `item ${hit.id}, label ${hit.label}`, loading: "lazy" } });
      // textContent: labels are user data, never HTML
      card.append(img, el("div", { cls: "label", text: hit.label }),
        el("div", { cls: "score", text: `score ${hit.score.toFixed(3)} · #${hit.id}` }));
      card.addEventListener("click", () => searchById(hit.id));
      results.append(card);
    }
  }

  fileInput.addEventListener("change", () => {
    const file = fileInput.files && fileInput.files[0];
    if (file) searchImage(file, file.name);
    fileInput.value = ""; // choosing the same file again still fires "change"
  });

  for (const type of ["dragenter", "dragover"]) {
    dropZone.addEventListener(type, (event) => {
      event.preventDefault();
      dropZone.classList.add("dragging");
    });
  }
  for (const type of ["dragleave", "drop"]) {
    dropZone.addEventListener(type, () => dropZone.classList.remove("dragging"));
  }
  dropZone.addEventListener("drop", (event) => {
    event.preventDefault();
    const file = event.dataTransfer.files && event.dataTransfer.files[0];
    if (file) searchImage(file, file.name);
  });
})();

imgret.loadCollections();
imgret.loadHealth();
// The other views register themselves in evaluate.js and models.js (loaded after this file):
// route once the page has parsed them all.
window.addEventListener("DOMContentLoaded", imgret.route);

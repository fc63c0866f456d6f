// imgret web page: choose or drop an image, POST it to /search, show the neighbours as a grid.
// Clicking a neighbour fetches its stored image and searches with it. Plain JS, no build step.
"use strict";

const fileInput = document.getElementById("file-input");
const dropZone = document.getElementById("drop-zone");
const preview = document.getElementById("query-preview");
const hint = document.getElementById("drop-hint");
const kInput = document.getElementById("k-input");
const labelInput = document.getElementById("label-input");
const statusLine = document.getElementById("status");
const results = document.getElementById("results");
const health = document.getElementById("health");

let previewUrl = null;

function setStatus(text, isError = false) {
  statusLine.textContent = text;
  statusLine.classList.toggle("error", isError);
}

function showPreview(blob) {
  if (previewUrl) URL.revokeObjectURL(previewUrl);
  previewUrl = URL.createObjectURL(blob);
  preview.src = previewUrl;
  preview.hidden = false;
  hint.textContent = "Drop or click to search with another image";
}

async function errorText(response) {
  // FastAPI errors are {"detail": "..."} or {"detail": [{msg, loc}, ...]} for validation.
  try {
    const body = await response.json();
    if (typeof body.detail === "string") return body.detail;
    if (Array.isArray(body.detail)) return body.detail.map((d) => d.msg).join("; ");
  } catch (_) {
    // not JSON
  }
  return `${response.status} ${response.statusText}`;
}

async function search(blob, name) {
  showPreview(blob);
  const form = new FormData();
  form.append("image", blob, name || "query");
  form.append("k", String(Math.min(1000, Math.max(1, Number(kInput.value) || 12))));
  const label = labelInput.value.trim();
  if (label) form.append("label", label);
  setStatus("searching…");
  results.setAttribute("aria-busy", "true");
  try {
    const response = await fetch("/search", { method: "POST", body: form });
    if (!response.ok) {
      setStatus(await errorText(response), true);
      return;
    }
    const body = await response.json();
    render(body.results);
    setStatus(`${body.results.length} neighbours in ${body.took_ms.toFixed(1)} ms · model ${body.model_version}`);
  } catch (err) {
    setStatus(`request failed: ${err}`, true);
  } finally {
    results.removeAttribute("aria-busy");
  }
}

function render(hits) {
  results.replaceChildren();
  for (const hit of hits) {
    const card = document.createElement("button");
    card.type = "button";
    card.className = "result";
    card.dataset.id = String(hit.id);
    card.title = `search with item ${hit.id}`;

    const img = document.createElement("img");
    img.src = `/gallery/${encodeURIComponent(hit.id)}/image`;
    img.alt = `item ${hit.id}, label ${hit.label}`;
    img.loading = "lazy";

    const label = document.createElement("div");
    label.className = "label";
    label.textContent = hit.label; // textContent: labels are user data, never HTML

    const score = document.createElement("div");
    score.className = "score";
    score.textContent = `score ${hit.score.toFixed(3)} · #${hit.id}`;

    card.append(img, label, score);
    card.addEventListener("click", () => searchById(hit.id));
    results.append(card);
  }
}

async function searchById(id) {
  setStatus(`loading item ${id}…`);
  const response = await fetch(`/gallery/${encodeURIComponent(id)}/image`);
  if (!response.ok) {
    setStatus(await errorText(response), true);
    return;
  }
  await search(await response.blob(), `item-${id}`);
}

fileInput.addEventListener("change", () => {
  const file = fileInput.files && fileInput.files[0];
  if (file) search(file, file.name);
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
  if (file) search(file, file.name);
});

async function loadHealth() {
  try {
    const response = await fetch("/health");
    const body = await response.json();
    health.textContent = `${body.index_size} images indexed · model ${body.model_version} · ${body.device}`;
  } catch (err) {
    health.textContent = "service unreachable";
  }
}

loadHealth();

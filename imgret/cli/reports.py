"""Evaluation reports as text for the terminal: the core computes them
(:mod:`imgret.gallery.evaluation.retrieval`, :mod:`imgret.gallery.evaluation.open_set`), the
commands print them (``imgret evaluate``, ``imgret demo``)."""

from __future__ import annotations

from typing import Any

# Labels shown by :func:`format_report`'s per-label table (the worst ones).
FORMAT_LABELS = 10


def format_report(report: dict[str, Any]) -> list[str]:
    """Human-readable lines of a report (``imgret evaluate`` prints them): a markdown table of
    every metric with its 95% interval, preceded by the protocol and model version, then the
    worst labels (at most :data:`FORMAT_LABELS`) with their most frequent confusion."""
    ci = report.get("ci95") or {}

    def interval(name: str, k: int | None = None) -> str:
        bounds = ci.get(name)
        if bounds is not None and k is not None:
            bounds = bounds.get(k, bounds.get(str(k)))
        return f"[{bounds[0]:.4f}, {bounds[1]:.4f}]" if bounds else ""

    lines = [
        f"query set: {report.get('query_set') or '(upload)'}; model version: "
        f"{report['model_version']}; gallery: {report['gallery_size']} items",
        f"protocol: {report['protocol']}",
        f"queries: {report['num_queries']} ({report['num_skipped']} skipped with R = 0, "
        f"{report['num_truncated']} with relevant items below depth {report['depth']})",
        "",
        "| metric | value | 95% CI |",
        "|---|---:|---|",
    ]
    for name in ("map_at_r", "r_precision", "precision_at_1", "mean_average_precision", "mrr"):
        lines.append(f"| {name} | {report[name]:.4f} | {interval(name)} |")
    for name in ("recall_at_k", "map_at_k", "ndcg_at_k", "recall_fraction_at_k"):
        for k, value in sorted((int(k), v) for k, v in report[name].items()):
            lines.append(f"| {name}@{k} | {value:.4f} | {interval(name, k)} |")
    lines += _format_open_set(report.get("open_set"))
    per_label = report.get("per_label") or []
    if per_label:
        shown = per_label[:FORMAT_LABELS]
        lines += [
            "",
            f"worst {len(shown)} of {len(per_label)} labels by MAP@R "
            "(top confusion: the wrong label retrieved most often in the top R):",
            "",
            "| label | queries | MAP@R | P@1 | top confusion |",
            "|---|---:|---:|---:|---|",
        ]
        for entry in shown:
            confusions = entry["confusions"]
            top = (f"{_cell(confusions[0]['label'])} ({confusions[0]['count']} hits)"
                   if confusions else "-")
            lines.append(f"| {_cell(entry['label'])} | {entry['count']} | "
                         f"{entry['map_at_r']:.4f} | {entry['precision_at_1']:.4f} | {top} |")
    return lines


def _format_open_set(section: dict[str, Any] | None) -> list[str]:
    """The open-set operating points and TAR@FAR as markdown tables (none without them)."""
    if not section:
        return []

    def estimate(entry: dict[str, Any] | None) -> str:
        if entry is None:
            return "-"
        bounds = entry.get("ci95")
        text = f"{entry['value']:.4f}"
        return text + (f" [{bounds[0]:.4f}, {bounds[1]:.4f}]" if bounds else "")

    lines = [
        "",
        f"open set: {section['mated']} mated and {section['non_mated']} non-mated queries; "
        f"candidates: {section['pairs']} (95% intervals resample identities)",
        "",
        "| target FPIR | threshold | FNIR | rank-1 identification | FPIR measured |",
        "|---:|---|---|---|---|",
    ]
    for point in section["operating_points"]:
        if point.get("threshold") is None:
            lines.append(f"| {point['fpir']:g} | {point.get('note') or '-'} | | | |")
            continue
        lines.append(f"| {point['fpir']:g} | {estimate(point['threshold'])} | "
                     f"{estimate(point['fnir'])} | {estimate(point['rank1_identification'])} "
                     f"| {estimate(point['fpir_measured'])} |")
    verification = section.get("verification")
    if verification:
        lines += ["", f"TAR@FAR over {verification['genuine_pairs']} same-label and "
                      f"{verification['impostor_pairs']} different-label pairs:", "",
                  "| FAR | TAR |", "|---:|---|"]
        for point in verification["points"]:
            lines.append(f"| {point['far']:g} | "
                         f"{estimate(point['tar']) if point['tar'] else point['note']} |")
    return lines


def _cell(text: str) -> str:
    """A label as a markdown table cell."""
    return text.replace("|", "\\|")

"""Benchmark output: one JSON object per result on stdout, a table of medians, and with
`--out DIR` also results.jsonl, results.md and a PNG plot."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict


def scratch_dir(prefix: str) -> str:
    """A scratch folder for one bench run (checkpoints, Ray Train's storage), removed when the
    process exits, unless ELASTIC_BENCH_KEEP=1. A 90 M-parameter recovery run leaves about 12 GB:
    kept, a few runs filled this machine's disk, and Ray Train then failed mid-save (2026-11-29)."""
    path = tempfile.mkdtemp(prefix=prefix)
    if os.environ.get("ELASTIC_BENCH_KEEP") != "1":
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def parse_systems(bench: str, arg: str | None, known: list[str]) -> list[str] | None:
    """`--systems a,b` checked against the benchmark's systems (all of them by default); None,
    after saying why on stderr, if one is unknown."""
    systems = [s.strip() for s in (arg or ",".join(known)).split(",") if s.strip()]
    unknown = set(systems) - set(known)
    if unknown:
        print(f"python -m benchmarks {bench}: --systems: unknown {sorted(unknown)}; choose from {', '.join(known)}",
              file=sys.stderr)
        return None
    return systems


def int_list(flag: str, arg: str, minimum: int = 1) -> list[int]:
    """`FLAG 1024,3072`: comma-separated integers of at least `minimum`; ValueError naming the flag."""
    try:
        values = [int(v) for v in arg.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {arg!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{flag}: expected values >= {minimum}, got {arg!r}")
    return values


def emit(record: dict) -> None:
    print(json.dumps(record, default=str), flush=True)


def append_results(out_dir: str, records) -> None:
    """Append records to results.jsonl in out_dir, one JSON object a line (a run cut short keeps
    what it measured)."""
    with open(os.path.join(out_dir, "results.jsonl"), "a") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")


def append_markdown(out_dir: str, text: str) -> None:
    with open(os.path.join(out_dir, "results.md"), "a") as f:
        f.write(text)


def write_report(out_dir: str | None, records: list[dict], table: str, notes: str,
                 json_name: str | None = None, json_data: dict | None = None) -> None:
    """Print the table and its notes; with `out_dir`, append the records and the table there, and
    write `json_name` (the summary) beside them."""
    print(table)
    print(f"- {notes}")
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    append_results(out_dir, records)
    append_markdown(out_dir, table + f"\n- {notes}\n\n")
    if json_name:
        with open(os.path.join(out_dir, json_name), "w") as f:
            json.dump(json_data, f, indent=2, default=str)


def medians(records: list[dict], metrics: list[str], key: str = "system") -> dict[str, dict[str, float | None]]:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by[r[key]].append(r)
    out = {}
    for system, rs in by.items():
        out[system] = {"n": len(rs)}
        for m in metrics:
            vals = [r[m] for r in rs if r.get(m) is not None]
            out[system][m] = statistics.median(vals) if vals else None
    return out


def markdown_table(med: dict[str, dict], metrics: list[str], title: str, notes: list[str] = ()) -> str:
    lines = [f"### {title}", "", "| system | reps | " + " | ".join(f"median {m}" for m in metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    for system, row in med.items():
        cells = [("-" if row[m] is None else f"{row[m]:.2f}") for m in metrics]
        lines.append(f"| {system} | {row['n']} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def report_against_peer(bench: str, title: str, records: list[dict], med: dict[str, dict], metrics: list[str],
                        ours: list[str], peer: str, notes: list[str], out_dir: str | None) -> None:
    """The end of a comparison: the ratio of each of our systems' median `metrics[0]` to the
    peer's (same run), a summary line, the table, and with `out_dir` the files and the plot."""
    metric = metrics[0]
    base = med.get(peer, {}).get(metric)
    ratios = {s: med[s][metric] / base for s in ours if base and med.get(s, {}).get(metric)}
    notes = list(notes) + [f"{metric} ratio {s} / {peer} (medians, same run): {r:.3f}" for s, r in ratios.items()]
    emit({"bench": bench, "summary": True, **{f"ratio_{metric}_{s}_over_{peer}": r for s, r in ratios.items()},
          **{f"median_{m}_{s}": v[m] for s, v in med.items() for m in metrics}})
    table = markdown_table(med, metrics, title, notes)
    print(table)
    if out_dir:
        write_outputs(out_dir, bench, records, table, metric)
        print(f"wrote {out_dir}/results.jsonl, results.md, {bench}.png")


def write_outputs(out_dir: str, name: str, records: list[dict], table_md: str, metric: str,
                  key: str = "system") -> None:
    os.makedirs(out_dir, exist_ok=True)
    append_results(out_dir, records)
    append_markdown(out_dir, table_md + "\n")
    _plot(os.path.join(out_dir, f"{name}.png"), records, metric, key, title=f"{name}: {metric} per repetition")


def _plot(path: str, records: list[dict], metric: str, key: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r[key] for r in records))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, s in enumerate(systems):
        vals = [r[metric] for r in records if r[key] == s and r.get(metric) is not None]
        if not vals:
            continue
        ax.bar(i, statistics.median(vals), color="#8fb3d9", width=0.6)
        ax.scatter([i] * len(vals), vals, color="#1f4e79", zorder=3, s=14)
    ax.set_xticks(range(len(systems)), systems)
    ax.set_ylabel(metric)
    ax.set_title(title + " (bar: median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def recovery_timeline(result) -> dict:
    """Where a recovery's seconds went, from its events: seconds from the fault to the failure's
    detection, to the replacements' start, to the new group's formation, to the state in place
    (and how it moved: restore_s, the copy's rate, how many ranks sent and received)."""
    (fault,) = result.events_of("fault_injected") or ({},)
    if not fault:
        return {}
    after = [e for e in result.events if e["t"] >= fault["t"]]

    def first(kind):
        return next((round(e["t"] - fault["t"], 2) for e in after if e["kind"] == kind), None)
    restored = next((e for e in after if e["kind"] == "restored"), {})
    recovered = next((e for e in after if e["kind"] == "recovered"), {})
    return {"t_detected": first("failure_detected"), "t_replaced": first("workers_replaced"),
            "t_formed": first("group_formed"), "t_restored": first("restored"),
            "restore_s": restored.get("restore_s"), "transfer_gb_per_s": restored.get("transfer_gb_per_s"),
            "senders": restored.get("senders"), "receivers": restored.get("receivers"),
            "restore_phases": restored.get("phases"), "state_in_place_s": recovered.get("state_in_place_s"),
            "moved_bytes": recovered.get("moved_bytes"), "moved_gb_per_s": recovered.get("moved_gb_per_s")}

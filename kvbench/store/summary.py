"""The table printed at the end of each job."""

from __future__ import annotations

from pathlib import Path


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "—" if x is None else str(x)


def summary_rows(result: dict) -> list[tuple[str, str]]:
    b = result["bpd"]
    rows = [
        ("status", result["status"]),
        ("model / method / seed", f"{result['model']} / {result['method']} / {result['seed']}"),
        ("bpd K target / measured", f"{_fmt(b.get('target_k'))} / {_fmt(b.get('measured_k'))}"),
        ("bpd V target / measured", f"{_fmt(b.get('target_v'))} / {_fmt(b.get('measured_v'))}"),
    ]
    if result.get("static_bytes"):
        rows.append(("static bytes (per model, not in bpd)", f"{result['static_bytes'] / 2**20:.3g} MiB"))
    for task, t in (b.get("by_task") or {}).items():  # docs/methods.md §0 v3, per task
        end = f"end {_fmt(t.get('end_k'))} / {_fmt(t.get('end_v'))}"
        if "prefill_end_k" in t:
            end += f", end of prefill {_fmt(t['prefill_end_k'])} / {_fmt(t['prefill_end_v'])}"
        rows.append((f"bpd K / V {task}", f"{_fmt(t['measured_k'])} / {_fmt(t['measured_v'])} ({end})"))
    for group, values in result.get("metrics", {}).items():
        if isinstance(values, dict):
            for key, value in values.items():
                if isinstance(value, bool) or key == "seed":  # settings, not measurements
                    continue
                if isinstance(value, float) and key.endswith("_s"):
                    rows.append((f"{group}/{key}", f"{value:.1f} s"))
                elif isinstance(value, (int, float)) or value is None:
                    rows.append((f"{group}/{key}", _fmt(value)))
    for key, value in result.get("timings", {}).items():
        rows.append((f"time/{key}", f"{value:.1f} s" if isinstance(value, float) else _fmt(value)))
    if result.get("error"):
        rows.append(("error", result["error"].strip().splitlines()[-1][:120]))
    return rows


def print_summary(result: dict, path: Path) -> None:
    rows = summary_rows(result)
    width = max(len(k) for k, _ in rows)
    print(f"\n{'─' * (width + 30)}")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"result: {path}\n{'─' * (width + 30)}")

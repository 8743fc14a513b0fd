"""The chaos benchmark's report: totals over the faults, the Markdown results table, and the plot.

Totals sum every count over the faults; their `recovery_s` is the slowest fault's recovery (None
when no fault measured one). The table has one row per fault and a totals row. The plot has two
panels: each fault's requests split into correct / failed clean / wrong, and each fault's time to
recover capacity, with corruptions injected against detected marked on the flip faults.
"""

from __future__ import annotations

KEYS = ("requests", "correct", "failed_clean", "wrong", "leaked_blocks", "corruptions_injected",
        "corruptions_detected", "false_positives", "recovery_s")


def totals(entries: list[dict]) -> dict:
    out = {k: sum(int(e[k]) for e in entries) for k in KEYS if k != "recovery_s"}
    recs = [e["recovery_s"] for e in entries if e["recovery_s"] is not None]
    out["recovery_s"] = max(recs) if recs else None
    return out


def _row(name: str, e: dict) -> str:
    rec = "-" if e["recovery_s"] is None else f"{e['recovery_s']:.2f}"
    cells = [name, *(str(e[k]) for k in KEYS if k != "recovery_s"), rec]
    return "| " + " | ".join(cells) + " |"


def format_table(report: dict) -> str:
    head = ["fault", "requests", "correct", "failed clean", "wrong", "leaked blocks", "corruptions injected",
            "detected", "false positives", "recovery (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [_row(e["fault"], e) for e in report["faults"]]
    lines.append(_row("**total**", report["totals"]))
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = report["faults"]
    names = [e["fault"] for e in faults]
    x = range(len(faults))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    bottom = [0] * len(faults)
    for key, color in (("correct", "tab:green"), ("failed_clean", "tab:orange"), ("wrong", "tab:red")):
        vals = [e[key] for e in faults]
        ax1.bar(x, vals, bottom=bottom, color=color, label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    t = report["totals"]
    ax1.set_ylabel("requests")
    ax1.set_title(f"pdserve bench chaos: {t['requests']} requests, {t['wrong']} wrong, "
                  f"{t['leaked_blocks']} blocks leaked, corruptions {t['corruptions_detected']}/"
                  f"{t['corruptions_injected']} detected, {t['false_positives']} false positives")
    ax1.legend(loc="upper right", fontsize=8)
    recs = [e["recovery_s"] or 0.0 for e in faults]
    ax2.bar(x, recs, color="tab:blue", label="time to recover capacity")
    for i, e in enumerate(faults):
        if e["corruptions_injected"] or e["corruptions_detected"]:
            ax2.annotate(f"{e['corruptions_detected']}/{e['corruptions_injected']}\ndetected",
                         (i, recs[i]), ha="center", va="bottom", fontsize=6)
    ax2.set_ylabel("recovery (s)")
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

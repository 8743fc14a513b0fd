"""Draw the simulated cache over time: one panel per policy, token slots (y) against steps (x).

Each slot a request holds is coloured by that request; filled slots are solid, reserved-but-empty
slots (waste) are pale and hatched, free slots are white. Rejections and growth failures are
marked above the panel with the request id, red when free capacity would have sufficed. So
the holes of contiguous allocation and the scattered blocks of paging are visible at a glance.
Needs results run with `record_layout=True`. Matplotlib with the Agg backend; the format (svg or
png) follows the file extension.
"""

from __future__ import annotations

from pathlib import Path

from allocsim.run import PolicyResult
from allocsim.scenario import Scenario

FORMATS = (".svg", ".png")


def _runs(layouts):
    """Merge a segment present at consecutive steps into one (first_step, steps, segment) run."""
    open_runs: dict[tuple, int] = {}  # segment -> first step
    out = []
    for t, segs in enumerate(layouts + [[]]):
        now = set(segs)
        for seg in list(open_runs):
            if seg not in now:
                first = open_runs.pop(seg)
                out.append((first, t - first, seg))
        for seg in segs:
            open_runs.setdefault(seg, t)
    return out


def draw_figure(results: list[PolicyResult], scenario: Scenario, path: str | Path) -> Path:
    """Write the figure to `path` (.svg or .png) and return the path."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"figure path {str(path)!r}: extension must be one of {', '.join(FORMATS)}")
    if any(len(r.layouts) != r.steps for r in results):
        raise ValueError("draw_figure needs results simulated with record_layout=True")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    cmap = plt.get_cmap("tab10" if len(scenario.requests) <= 10 else "tab20")
    colour = {r.id: cmap(i % cmap.N) for i, r in enumerate(scenario.requests)}
    cap = scenario.capacity
    steps = max(r.steps for r in results)
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.7 * len(results) + 0.6), sharex=True,
                             squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        polys = {True: ([], []), False: ([], [])}  # live? -> (rectangles, colours)
        for first, n, (start, length, rid, live) in _runs(res.layouts):
            x0, x1, y0, y1 = first, first + n, start, start + length
            polys[live][0].append([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
            polys[live][1].append(colour[rid])
        ax.add_collection(PolyCollection(polys[True][0], facecolors=polys[True][1], edgecolors="none"))
        pale = [(r, g, b, 0.3) for r, g, b, _ in polys[False][1]]
        ax.add_collection(PolyCollection(polys[False][0], facecolors=pale, edgecolors=polys[False][1],
                                         linewidths=0, hatch="////"))
        if res.name.startswith("paged_"):
            b = int(res.name.split("_")[1])
            if cap % b:  # slots beyond the last whole block are never usable
                ax.axhspan(cap // b * b, cap, color="0.85")
        stacked: dict[int, int] = {}  # step -> failures already marked there
        for e in res.events:
            if e.kind in ("rejected", "growth_failure"):
                k = stacked[e.step] = stacked.get(e.step, -1) + 1
                ax.annotate(("\u00d7 " if e.kind == "rejected" else "\u25bc ") + e.request,
                            (e.step + 0.5, cap), xytext=(0, 2 + 10 * k), textcoords="offset points",
                            ha="center", va="bottom", fontsize=8, annotation_clip=False,
                            color="red" if e.free >= e.asked else "black")
        marker_rows = max(stacked.values()) + 1 if stacked else 0
        ax.set_xlim(0, steps)
        ax.set_ylim(0, cap)
        ax.set_ylabel("slot")
        ax.set_title(f"{res.name}: admitted {res.admitted}, rejected {res.rejected}, growth failures "
                     f"{res.growth_failures} ({res.failures_despite_free_capacity} despite free capacity), "
                     f"completed {res.completed}, peak waste {res.peak_waste}",
                     fontsize=9, loc="left", pad=6 + 10 * marker_rows)
        ax.grid(axis="x", color="0.9", linewidth=0.5)
    axes[-1, 0].set_xlabel("step")
    handles = [Patch(facecolor=colour[r.id], label=r.id) for r in scenario.requests]
    handles += [Patch(facecolor=(0.5, 0.5, 0.5, 0.3), edgecolor="0.5", hatch="////", label="waste"),
                Patch(facecolor="white", edgecolor="0.5", label="free")]
    fig.legend(handles=handles, loc="upper right", fontsize=8, title="request", ncol=1,
               bbox_to_anchor=(0.995, 0.97))
    fig.suptitle(f"KV cache of {cap} slots over time: \u00d7 rejected, \u25bc growth failure "
                 f"(red: enough free slots in total)", fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

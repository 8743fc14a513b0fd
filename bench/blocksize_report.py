"""The report of `pdserve bench blocksize`: `build_report` turns the per-size measurements into the
JSON (one record per block size with the issue's keys, taken from the trace each key is about:
admission and waste from the seed trace beside the simulator, timings from the mixed trace, copy-
on-write and prefix hits from the shared-prefix trace, migration of the mixed prompts; the full
per-trace breakdown under `traces`), the re-blocking rows and the answer text; `write_outputs`
prints the table and the answer and writes the JSON and the figure (`plot`: waste, TPOT,
migration time and prefix-hit rate against block size on a log2 axis, the waste- and
TPOT-minimising sizes marked). Matplotlib (Agg) is imported only when plotting.
"""

from __future__ import annotations

import dataclasses
import json

FIELDS = {  # top-level per-size key -> where it comes from
    "admitted/rejected/preemptions/completed/peak_waste/peak_reserved": "engine, seed trace (80 slots)",
    "sim_*": "allocator simulator (allocsim paged policy), seed trace",
    "alloc_us_per_step/attn_ms_per_step/attn_ms_per_prefill_token/tpot_ms/tokens_per_s":
        "engine, mixed trace (median of the timed repeats)",
    "*_gather": "engine, mixed trace, one run with the decode mirror off (decode gathers K/V through the "
                "block table every step, as a paged GPU kernel reads it)",
    "cow_bytes/prefix_hit_rate": "engine, shared-prefix trace (n > 1, prefix caching on)",
    "migration_ms": "ZeroMQ tcp migration of the mixed trace's first prompts, mean per sequence, equal B",
}


def _agree(a: list[int], b: list[int]) -> str:
    n = min(len(a), len(b))
    return f"{sum(x == y for x, y in zip(a, b))}/{n} steps equal (engine {len(a)} steps, sim {len(b)})"


def _size_record(B: int, m: dict, migration: dict) -> dict:
    seed, mixed, shared = m["traces"]["seed"], m["traces"]["mixed"], m["traces"]["shared"]
    sim = m["sim"]
    traces = {}
    for name, r in m["traces"].items():
        r = dict(r)
        series = r.pop("waste_series", [])
        sim_of = sim.get(name.split("_")[0])
        if sim_of is not None:
            r["sim"] = {k: v for k, v in sim_of.items() if k != "waste_series"}
            r["waste_agreement"] = _agree(series, sim_of["waste_series"])
        if name == "seed":
            r["waste_series"], r["sim_waste_series"] = series, sim["seed"]["waste_series"]
        traces[name] = r
    return {"block_size": B, "admitted": seed["admitted"], "rejected": seed["rejected"],
            "preemptions": seed["preemptions"], "completed": seed["completed"],
            "peak_waste": seed["peak_waste"], "sim_peak_waste": sim["seed"]["peak_waste"],
            "peak_reserved": seed["peak_reserved"], "sim_peak_reserved": sim["seed"]["peak_reserved"],
            "sim_rejected": sim["seed"]["rejected"], "sim_growth_failures": sim["seed"]["growth_failures"],
            "alloc_us_per_step": mixed["alloc_us_per_step"],
            "alloc_calls_per_step": mixed["alloc_calls_per_step"],
            "attn_ms_per_step": mixed["attn_ms_per_step"],
            "attn_ms_per_prefill_token": mixed["attn_ms_per_prefill_token"],
            "tpot_ms": mixed["tpot_ms"], "tokens_per_s": mixed["tokens_per_s"],
            "attn_ms_per_step_gather": m["traces"]["mixed_gather"]["attn_ms_per_step"],
            "tpot_ms_gather": m["traces"]["mixed_gather"]["tpot_ms"],
            "cow_bytes": shared["cow_bytes"], "prefix_hit_rate": shared["prefix_hit_rate"],
            "migration_ms": migration["migration_ms"], "traces": traces,
            **({"migration_error": migration["error"]} if "error" in migration else {})}


def _argmin(rows: list[dict], key) -> int:
    """Block size with the smallest key(row) (ties: the smaller block size)."""
    return min(rows, key=lambda r: (key(r), r["block_size"]))["block_size"]


def build_report(cfg, per: dict, migrations: dict, lengths: list[int], shortened: list[str]) -> dict:
    sizes = [_size_record(B, per[B], migrations[(B, B)]) for B in cfg.sizes]
    reblocking = []
    for s, d in [(b, b) for b in cfg.sizes if b in (16, 32)] + list(cfg.reblock_pairs):
        ms, eq_s, eq_d = (migrations[p]["migration_ms"] for p in ((s, d), (s, s), (d, d)))
        ok = None not in (ms, eq_s, eq_d)
        reblocking.append({"src_block_size": s, "dst_block_size": d, "migration_ms": ms, "equal_src_ms": eq_s,
                           "equal_dst_ms": eq_d, "vs_equal_src": ms / eq_s if ok else None,
                           "vs_faster_equal": ms / min(eq_s, eq_d) if ok else None,
                           **{k: v for k, v in migrations[(s, d)].items() if k == "error"}})
    best = {"waste": _argmin(sizes, lambda r: (r["traces"]["mixed"]["peak_waste"], r["peak_waste"])),
            "tpot": _argmin(sizes, lambda r: r["tpot_ms"]),
            "migration": _argmin(sizes, lambda r: (r["migration_ms"] is None, r["migration_ms"] or 0.0)),
            "attention": _argmin(sizes, lambda r: r["attn_ms_per_step"] or 0.0),
            "allocator": _argmin(sizes, lambda r: r["alloc_us_per_step"]),
            "prefix_hit": _argmin(sizes, lambda r: -r["prefix_hit_rate"])}
    report = {"config": {k: v for k, v in dataclasses.asdict(cfg).items()}, "quick": bool(shortened),
              "shortened": shortened, "fields": FIELDS, "migration_sequence_tokens": lengths,
              "sizes": sizes, "reblocking": reblocking, "minimizers": best}
    report["answer"] = answer(report)
    return report


def _ms(x) -> str:
    return "failed" if x is None else f"{x:.2f} ms"


def answer(report: dict) -> str:
    rows = {r["block_size"]: r for r in report["sizes"]}
    b = report["minimizers"]
    w, t, m = rows[b["waste"]], rows[b["tpot"]], rows[b["migration"]]
    lo, hi = min(rows), max(rows)
    mixed = lambda B: rows[B]["traces"]["mixed"]["peak_waste"]  # noqa: E731
    same = b["waste"] == b["tpot"] == b["migration"]
    text = [f"{'Yes' if same else 'No'}: waste is lowest at B={b['waste']} (peak waste "
            f"{w['peak_waste']} slots on the seed trace, simulator {w['sim_peak_waste']}; "
            f"{mixed(b['waste'])} on the mixed trace), TPOT at B={b['tpot']} ({t['tpot_ms']:.2f} ms vs "
            f"{w['tpot_ms']:.2f} ms at B={b['waste']}), migration time at B={b['migration']} "
            f"({_ms(m['migration_ms'])} per sequence vs {_ms(w['migration_ms'])} at B={b['waste']})."]
    held = max(B for B in rows if "note" not in rows[B]["traces"]["seed"])  # the 80-slot pool holds a block
    text.append(f"Across B={lo}..{hi}: seed-trace peak waste {rows[lo]['peak_waste']} -> "
                f"{rows[held]['peak_waste']} slots (B={held}; larger blocks do not fit its 80 slots), "
                f"mixed {mixed(lo)} -> {mixed(hi)}; TPOT {rows[lo]['tpot_ms']:.2f} -> "
                f"{rows[hi]['tpot_ms']:.2f} ms; allocator "
                f"{rows[lo]['alloc_us_per_step']:.0f} -> {rows[hi]['alloc_us_per_step']:.0f} us per step; "
                f"prefix-hit rate {rows[lo]['prefix_hit_rate']:.2f} -> {rows[hi]['prefix_hit_rate']:.2f}; "
                f"copy-on-write {rows[lo]['cow_bytes']} -> {rows[hi]['cow_bytes']} bytes.")
    rb = [r for r in report["reblocking"] if r["src_block_size"] != r["dst_block_size"]]
    if rb:
        text.append("Re-blocking vs the sender's equal size: " + ", ".join(
            f"{r['src_block_size']}->{r['dst_block_size']} {_ms(r['migration_ms'])} "
            f"({'-' if r['vs_equal_src'] is None else format(r['vs_equal_src'], '.2f')}x)" for r in rb) + ".")
    return " ".join(text)


def format_table(report: dict) -> str:
    cols = [("B", "block_size", "{}"), ("adm", "admitted", "{}"), ("rej", "rejected", "{}"),
            ("pre", "preemptions", "{}"), ("waste", "peak_waste", "{}"), ("sim", "sim_peak_waste", "{}"),
            ("alloc_us", "alloc_us_per_step", "{:.0f}"), ("attn_ms", "attn_ms_per_step", "{:.2f}"),
            ("tpot_ms", "tpot_ms", "{:.2f}"), ("tok/s", "tokens_per_s", "{:.0f}"),
            ("cow_B", "cow_bytes", "{}"),
            ("hit", "prefix_hit_rate", "{:.2f}"), ("mig_ms", "migration_ms", "{:.2f}")]
    lines = ["  ".join(f"{h:>8}" for h, _, _ in cols)]
    for r in report["sizes"]:
        lines.append("  ".join(f"{'-' if r[k] is None else f.format(r[k]):>8}" for _, k, f in cols))
    return "\n".join(lines)


def write_outputs(report: dict, json_path: str | None, plot_path: str | None, log) -> None:
    print(format_table(report))
    print(report["answer"])
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        log(f"wrote {json_path}")
    if plot_path:
        plot(report, plot_path)
        log(f"wrote {plot_path}")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["sizes"]
    xs = [r["block_size"] for r in rows]
    get = lambda f: [f(r) for r in rows]  # noqa: E731
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [
        (axes[0][0], "peak waste (slots)", [
            ("seed, engine", get(lambda r: None if "note" in r["traces"]["seed"] else r["peak_waste"]), "-"),
            ("seed, simulator", get(lambda r: None if "note" in r["traces"]["seed"] else r["sim_peak_waste"]),
             "--"),
            ("mixed, engine", get(lambda r: r["traces"]["mixed"]["peak_waste"]), "-"),
            ("mixed, simulator", get(lambda r: r["traces"]["mixed"]["sim"]["peak_waste"]), "--"),
            ("shared prefix, engine", get(lambda r: r["traces"]["shared"]["peak_waste"]), "-")]),
        (axes[0][1], "ms (mixed trace)", [
            ("TPOT", get(lambda r: r["tpot_ms"]), "-"),
            ("attention per decode step", get(lambda r: r["attn_ms_per_step"]), "--"),
            ("TPOT, decode mirror off", get(lambda r: r["tpot_ms_gather"]), ":"),
            ("attention per decode step, mirror off", get(lambda r: r["attn_ms_per_step_gather"]), ":")]),
        (axes[1][0], "ms per sequence", [
            ("migration over ZeroMQ (equal B)", get(lambda r: r["migration_ms"]), "-")]),
        (axes[1][1], "prefix-cache hit rate", [
            ("shared-prefix trace", get(lambda r: r["prefix_hit_rate"]), "-")]),
    ]
    best = report["minimizers"]
    for ax, ylabel, lines in panels:
        for label, ys, style in lines:
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            ax.plot(*zip(*pts), style, marker="o", label=label)
        ax.axvline(best["waste"], color="tab:green", linestyle=":", label=f"least waste (B={best['waste']})")
        ax.axvline(best["tpot"], color="tab:red", linestyle="-.", label=f"least TPOT (B={best['tpot']})")
        if ax is axes[0][0]:
            ax.set_yscale("symlog", linthresh=10)  # seed-trace waste is tens of slots, mixed thousands
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    cfg = report["config"]
    fig.suptitle(f"pdserve bench blocksize: model {cfg['model']}, CPU torch backend, "
                 f"{cfg['capacity_tokens']} KV slots (seed trace 80){', quick' if report['quick'] else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""docs/results.md from the benchmarks' JSON (`pdserve bench report`).

The results folder holds one subfolder per machine and in it the latest run of each benchmark:
`docs/results/<machine>/<bench>.json`, where <bench> names the command and its variant
(`engine-tiny-short`, `weights-gguf-1thread`, `migrate-quick`, ...). The machine's name is built
from what the JSON recorded (`machine_name`); a JSON that recorded its machine must sit in that
machine's folder, so a run filed under the wrong machine fails the report instead of mislabelling
its figures. `render` is a pure function of the folder: the same JSON always gives the same
Markdown, which is what lets a test check the committed docs/results.md.

Every figure is printed beside the baseline measured in the same run (transformers, llama.cpp,
f32 weights, memcpy and a raw TCP socket, the planner's prediction beside the measurement).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from bench import report_serving

RESULTS_DIR = Path("docs/results")
OUTPUT = Path("docs/results.md")
VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}

Row = tuple[str, str, str, str]  # (figure, pdserve, baseline, ratio or verdict)


class ResultsError(ValueError):
    """A results folder that cannot be reported as it stands (bad JSON, a run in the wrong folder)."""


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(\w+\)", "", text.lower())).strip("-")


def machine_name(record: dict) -> str | None:
    """The folder name of the machine a benchmark JSON recorded, or None when it recorded none.

    CPU runs: vendor, the first word of the model name after it, family and model number
    (`amd-epyc-f25m1`, `intel-xeon-f6m167`); GPU kernel runs: the device (`nvidia-h200`)."""
    machine = record.get("machine")
    if isinstance(machine, dict) and isinstance(machine.get("cpu"), dict):
        cpu = machine["cpu"]
        vendor = VENDORS.get(cpu.get("vendor", ""), _slug(cpu.get("vendor", "cpu")))
        words = [w for w in _slug(cpu.get("model", "")).split("-") if w and w != vendor]
        family = words[0] if words else "cpu"
        return f"{vendor}-{family}-f{cpu.get('family')}m{cpu.get('model_number')}"
    device = record.get("device")
    if isinstance(device, str) and device not in ("cpu", "cuda"):
        return _slug(device)
    return None


def load(results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, dict]]:
    """{machine: {bench: record}} for every docs/results/<machine>/<bench>.json, sorted by name."""
    if not results_dir.is_dir():
        raise ResultsError(f"no results folder at {results_dir}")
    out: dict[str, dict[str, dict]] = {}
    for folder in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        runs: dict[str, dict] = {}
        for path in sorted(folder.glob("*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ResultsError(f"{path}: not readable JSON ({exc})") from exc
            recorded = machine_name(record)
            if recorded is not None and recorded != folder.name:
                raise ResultsError(f"{path} recorded machine {recorded!r}, but sits in {folder.name!r}")
            runs[path.stem] = record
        if runs:
            out[folder.name] = runs
    return out


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def _engine(r: dict) -> list[Row]:
    cfg = r.get("config", {})
    ours = r.get("pdserve", {}).get("tokens_per_s_median")
    theirs = r.get("transformers", {}).get("tokens_per_s_median")
    rows: list[Row] = [(f"tokens/s, {cfg.get('num_prompts')} prompts batched ({cfg.get('weights', 'f32')}) "
                        "vs transformers", _num(ours), _num(theirs), _ratio(ours, theirs))]
    llama = r.get("llamacpp")
    if isinstance(llama, dict) and llama.get("batched_tokens_per_s_median"):
        rows.append(("tokens/s, batched vs llama.cpp", _num(ours), _num(llama["batched_tokens_per_s_median"]),
                     _ratio(ours, llama["batched_tokens_per_s_median"])))
        a, b = llama.get("pdserve_single_decode_tokens_per_s_median"), llama.get(
            "single_decode_tokens_per_s_median")
        rows.append(("single-stream decode tok/s vs llama.cpp", _num(a), _num(b), _ratio(a, b)))
        bw = llama.get("single_decode_bandwidth", {})
        if bw:
            rows.append(("single-stream weight bytes/step over step time, share of copy bandwidth",
                         f"{bw['pdserve']['fraction_of_copy_bandwidth']:.0%}",
                         f"{bw['llamacpp']['fraction_of_copy_bandwidth']:.0%}", "-"))
    return rows


def _weights(r: dict) -> list[Row]:
    formats = {f["weights"]: f for f in r.get("formats", [])}
    base = formats.get("f32", {})
    rows: list[Row] = []
    for name, f in formats.items():
        if name == "f32":
            continue
        ours, theirs = f["single"]["tokens_per_s"], base.get("single", {}).get("tokens_per_s")
        rows.append((f"{name}: single-stream decode tok/s vs f32", _num(ours), _num(theirs),
                     _ratio(ours, theirs)))
        rows.append((f"{name}: weight bytes/step over step time, share of copy bandwidth",
                     f"{f['fraction_of_copy_bandwidth']:.0%}",
                     f"{base['fraction_of_copy_bandwidth']:.0%}" if base else "-", "-"))
        rows.append((f"{name}: perplexity (top-1 agreement with f32)",
                     f"{f['perplexity']:.3f} ({f.get('top1_agreement', 0):.1%})",
                     _num(base.get("perplexity"), 3), "-"))
    return rows


def _migrate(r: dict) -> list[Row]:
    rows: list[Row] = []
    largest: dict[str, dict] = {}
    for res in r.get("results", []):
        if res.get("bytes", 0) >= largest.get(res["transport"], {}).get("bytes", -1):
            largest[res["transport"]] = res
    sizes = sorted({res["bytes"] for res in largest.values()})
    for b in r.get("baselines", []):
        if b["name"] == "memcpy" and b.get("bytes") in sizes[-1:]:
            rows.append((f"memcpy of {b['bytes'] / 2**20:.1f} MiB, GB/s (the ceiling)", "-",
                         _num(b["gb_per_s"], 2), "-"))
    for transport, res in sorted(largest.items()):
        same = {b["name"]: b["gb_per_s"] for b in r.get("baselines", []) if b.get("bytes") == res["bytes"]}
        raw = same.get("raw_tcp")
        rows.append((f"{transport}: GB/s moving {res['bytes'] / 2**20:.1f} MiB ({res['kv_shape']}), "
                     "vs raw TCP", _num(res["gb_per_s"], 2), _num(raw, 2), _ratio(res["gb_per_s"], raw)))
    return rows


def _chaos(r: dict) -> list[Row]:
    t = r.get("totals", {})
    return [("requests answered correctly / failed cleanly", f"{t['correct']} / {t['failed_clean']}",
             f"{t['requests']} sent", "-"),
            ("wrong answers, leaked blocks", f"{t['wrong']}, {t['leaked_blocks']}", "0, 0",
             "pass" if t["wrong"] == 0 and t["leaked_blocks"] == 0 else "FAIL"),
            ("corruptions detected", str(t["corruptions_detected"]), f"{t['corruptions_injected']} injected",
             "pass" if t["corruptions_detected"] == t["corruptions_injected"] else "FAIL")]


def _fuzz(r: dict) -> list[Row]:
    bad = {k: r[k] for k in ("crashes", "hangs", "leaks", "false_positives")}
    return [(f"{r['cases']:,} mutated cases: " + ", ".join(bad), ", ".join(str(v) for v in bad.values()),
             ", ".join("0" for _ in bad), "pass" if not any(bad.values()) else "FAIL")]


def _sim(r: dict) -> list[Row]:
    """`bench sim`: seeds (its seeds and their broken invariants), or an exhaustive exploration."""
    if "runs" in r:  # --exhaustive
        case = (f"{r['requests']} request{'s' if r['requests'] > 1 else ''}, <= {r['max_faults']} "
                f"fault{'s' if r['max_faults'] > 1 else ''} in the first {r['max_messages']} sends"
                f"{', streamed' if r.get('stream') else ''}, {r['transport']}")
        return [(f"exhaustive ({case}): {r['runs']:,} runs, {r['states']:,} distinct states in "
                 f"{r['seconds']:.0f} s ({'complete' if r['complete'] else 'NOT complete'}): violations",
                 "none" if not r["violation"] else "1", "none",
                 "pass" if r["complete"] and not r["violation"] else "FAIL")]
    broken = len(r["failures"])
    jobs = r.get("jobs", 1)
    return [(f"{r['seeds']:,} seeds under {r['transport']}'s guarantees: broken invariants", str(broken),
             "0", "pass" if not broken else "FAIL"),
            (f"seeds per second ({jobs} process{'es' if jobs > 1 else ''}), wall time",
             _num(r["seeds_per_s"], 0), f"{r['seconds'] / 60:.1f} min", "-")]


def _plan_validate(r: dict) -> list[Row]:
    rows: list[Row] = []
    for row in r.get("validate", {}).get("rows", []):
        m, p = row["measured"], row["predicted"]
        for key, label in (("ttft_p50", "TTFT p50 ms"), ("tpot_p50", "TPOT p50 ms"),
                           ("goodput", "goodput req/s")):
            rows.append((f"{row['config']} at {row['rate']:g} req/s: {label}, predicted vs measured",
                         _num(p.get(key)), _num(m.get(key)), _ratio(p.get(key), m.get(key))))
    goodput = r.get("validate", {}).get("goodput") or {}
    for config, c in (goodput.get("configs") or {}).items():
        rows.append((f"{config}: goodput search req/s, predicted vs measured", _num(c["predicted"], 2),
                     _num(c["measured"], 2), _ratio(c["predicted"], c["measured"])))
    if goodput.get("predicted_best"):
        rows.append(("the configuration picked, predicted vs measured (tied with the best)",
                     goodput["predicted_best"], ", ".join(goodput["measured_tied_with_best"]),
                     "match" if goodput["pick_matches"] else "DIFFERENT"))
    return rows


def _small_move(r: dict) -> list[Row]:
    total = r["two_processes_ms_p50"]["total"]
    steps = sum(r["in_process_us_p50"].values()) / 1000
    return [(f"{r['payload_bytes'] // 1024} KiB migration between two processes, ms p50, vs its steps "
             "in one process", _num(total, 3), _num(steps, 3), _ratio(total, steps))]


def _decode(r: dict) -> list[Row]:
    rows: list[Row] = []
    for case in r.get("cases", []):
        us = case["us_per_layer_step"]
        rows.append((f"{case['case']}: us per layer-step, paged kernel vs block gather", _num(us["kernel"]),
                     _num(us["gather"]), _ratio(us["gather"], us["kernel"]) + " faster"))
    return rows


def _kernels(r: dict) -> list[Row]:
    return [(f"{k['kernel']} " + ", ".join(f"{n}={k[n]}" for n in ("tokens", "num_seqs", "context") if n in k)
             + ": ms, Triton vs torch", _num(k.get("triton_ms"), 3), _num(k.get("torch_ms"), 3),
             f"{k['speedup']:.2f}x" if k.get("speedup") else "-") for k in r.get("results", [])]


SUMMARIES: dict[str, Callable[[dict], list[Row]]] = {
    "engine": _engine, "weights": _weights, "migrate": _migrate, "chaos": _chaos, "fuzz": _fuzz,
    "plan-validate": _plan_validate, "small-move": _small_move, "decode": _decode, "kernels": _kernels,
    "sim": _sim,
}


def summarize(bench: str, record: dict) -> list[Row]:
    """The rows of one benchmark's table, picked by its name's prefix (none for a kind without one)."""
    for prefix in sorted(SUMMARIES, key=len, reverse=True):
        if bench == prefix or bench.startswith(prefix + "-"):
            return SUMMARIES[prefix](record)
    return []


# The README's results table: (bench, start of a figure) on HEADLINE_MACHINE, in this order.
HEADLINE_MACHINE = "amd-epyc-f25m1"
HEADLINE = (("engine-tiny-short", "tokens/s"), ("engine-tiny-long", "tokens/s"),
            ("engine-smollm2-long", "tokens/s"), ("weights-gguf-1thread", "gguf: single-stream"),
            ("weights-gguf-1thread", "gguf: perplexity"), ("migrate-quick", "zmq-tcp"),
            ("migrate-quick", "zmq-shm"), ("chaos-quick", "wrong"), ("chaos-quick", "corruptions"),
            ("fuzz-20000", ""))


def headline(results_dir: Path = RESULTS_DIR, machine: str = HEADLINE_MACHINE) -> list[str]:
    """The headline table's Markdown lines: one row per HEADLINE entry, from the machine's latest runs."""
    runs = load(results_dir)[machine]
    lines = ["| benchmark | figure | pdserve | baseline | ratio |", "|---|---|---|---|---|"]
    for bench, start in HEADLINE:
        row = next(r for r in summarize(bench, runs[bench]) if r[0].startswith(start))
        lines.append(f"| `{bench}` | " + " | ".join(row) + " |")
    return lines


def describe_machine(runs: dict[str, dict]) -> str:
    """One line on the machine, from the first run that recorded it."""
    for record in runs.values():
        machine = record.get("machine")
        if isinstance(machine, dict) and isinstance(machine.get("cpu"), dict):
            cpu, cores = machine["cpu"], machine.get("cores", {})
            bw = machine.get("memory_copy_gb_per_s")
            bandwidth = f", copy bandwidth {bw:.1f} GB/s" if bw else ""
            return (f"{cpu.get('model')} (family {cpu.get('family')}, model {cpu.get('model_number')}), "
                    f"{cores.get('physical')} physical cores{bandwidth}")
        if isinstance(record.get("device"), str):
            return record["device"]
    return "not recorded"


def render(results_dir: Path = RESULTS_DIR) -> str:
    """docs/results.md's text for this results folder."""
    machines = load(results_dir)
    lines = ["# Results", "",
             "Generated by `pdserve bench report` from `docs/results/<machine>/<bench>.json`, the latest run",
             "of each benchmark on each machine; do not edit by hand. Each figure sits beside the baseline",
             "measured in the same run. How to run each benchmark and read it:",
             "[benchmarks.md](benchmarks.md).",
             "", f"## Headline ({HEADLINE_MACHINE}, the table in the README)", "", *headline(results_dir), ""]
    for machine, runs in machines.items():
        lines += [f"## {machine}", "", describe_machine(runs), ""]
        study = report_serving.table(runs)
        if study:
            files = ", ".join(f"[{b}.json](results/{machine}/{b}.json)" for b in runs
                              if b.startswith(("serve-", "plan-")))
            lines += ["### serving study", "",
                      "Goodput in req/s [95% interval] at >= 90% of requests within both SLOs; a ratio's "
                      "\"(tie)\" means the intervals overlap. How to read it: "
                      "[benchmarks-serving.md](benchmarks-serving.md).", "", *study, "",
                      "Latency at the rate where the best configuration saturates (each kind's best setup; "
                      "where it did not run that rate, its nearest one):", "",
                      *report_serving.saturation(runs), ""]
            if (results_dir / machine / report_serving.PLOT).exists():
                lines += [f"![goodput per workload](results/{machine}/{report_serving.PLOT})", ""]
            lines += [files, ""]
        for bench, record in runs.items():
            if bench.startswith(("serve-", "plan-")) and study:
                continue  # in the study's table
            rows = summarize(bench, record)
            link = f"[{bench}.json](results/{machine}/{bench}.json)"
            if not rows:
                lines += [f"- `{bench}`: {link} (no summary; read the JSON)", ""]
                continue
            lines += [f"### {bench}", "", link, "", "| figure | pdserve | baseline | ratio |",
                      "|---|---|---|---|"]
            lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
            lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"

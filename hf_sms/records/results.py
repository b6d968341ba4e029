"""Results of SMS runs: results.json, a table shaped like the paper's Table 1, a plot, a timeline of the processes,
and the ``hf-sms table`` / ``hf-sms timeline`` commands that print them."""

from __future__ import annotations

import json
import os
import statistics
import sys

from ..atomic import atomic_path, atomic_write
from ..runtime.speed import format_measured

ROW_ORDER = tuple(
    "sms_uniform sms_greedy best_candidate best_candidate_by_test mean_candidate ensemble imp_mx imp_phases imp_swa "
    "swamp imp_reprune imp_reprune_cia imp_reprune_caa imp".split()
)
ROW_NAMES = {
    "sms_uniform": "SMS (uniform)",
    "sms_greedy": "SMS (greedy)",
    "best_candidate": "best candidate (by validation)",
    "best_candidate_by_test": "best candidate by test (the paper's row)",
    "mean_candidate": "mean candidate",
    "ensemble": "ensemble (not a single model)",
    "imp_mx": "IMP_mx",
    "imp_phases": "IMP with m phases",
    "imp_swa": "IMP + SWA",
    "swamp": "SWAMP",
    "imp_reprune": "IMP-RePrune",
    "imp_reprune_cia": "IMP-RePrune (CIA)",
    "imp_reprune_caa": "IMP-RePrune (CAA)",
    "imp": "IMP",
}


def row_name(method: str) -> str:
    """A row's label: the known ones, ``sms_ties`` as "SMS (ties)", a later soup trajectory's candidate rows
    (``mean_candidate_ties``) as "mean candidate (ties trajectory)"."""
    if method in ROW_NAMES:
        return ROW_NAMES[method]
    if method.startswith("sms_"):
        return f"SMS ({method[4:]})"
    base = next(
        (b for b in ("best_candidate_by_test", "best_candidate", "mean_candidate") if method.startswith(b + "_")), None
    )
    return f"{ROW_NAMES[base]} ({method[len(base) + 1 :]} trajectory)" if base else method


def _order(methods) -> list[str]:
    """Known rows first (SMS rows of other soups after the greedy one), then the rest by name."""
    known = [m for m in ROW_ORDER if m in methods]
    soups = sorted(m for m in methods if m.startswith("sms_") and m not in known)
    at = known.index("sms_greedy") + 1 if "sms_greedy" in known else int("sms_uniform" in known)
    return known[:at] + soups + known[at:] + sorted(set(methods) - set(known) - set(soups))


def value(row: dict, split: str) -> float | None:
    """A row's score on ``split``: "val", "test" (the first test set) or any named test set."""
    return row[split] if split in ("val", "test") else row.get("tests", {}).get(split)


def metric_table(runs: list[dict], split: str = "test") -> dict[str, list[list[float]]]:
    """``{method: [[value per run] per phase]}`` for one split, ensemble included from the diagnostics."""
    table: dict[str, list[list[float]]] = {}
    for run in runs:
        rows = dict(run["rows"])
        sms = [d for d in run.get("sms", []) if d.get("trajectory") == run["sms"][0].get("trajectory")]
        if sms and f"ensemble_{split}" in sms[0]:  # the candidates of the first (reported) trajectory
            rows["ensemble"] = [{split: d[f"ensemble_{split}"]} for d in sms]
        for method, phases in rows.items():
            cols = table.setdefault(method, [[] for _ in phases])
            for col, row in zip(cols, phases):
                if value(row, split) is not None:
                    col.append(value(row, split))
    return table


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def format_table(runs: list[dict], split: str = "test") -> str:
    """Markdown table: rows are methods, columns are the dense model and the phases (mean ± std over runs)."""
    phases = runs[0]["phases"]
    table = metric_table(runs, split)
    dense = [value(r["dense"], split) for r in runs if r.get("dense") and value(r["dense"], split) is not None]
    head = "| method | " + " | ".join(f"phase {i + 1} (target {100 * s:.1f}%)" for i, s in enumerate(phases)) + " |"
    lines = [head, "|" + "---|" * (len(phases) + 1), _achieved(runs[0], len(phases))]
    if dense:  # the paper's "unpruned" value, the same for every phase
        lines.append(f"| dense (unpruned) | {_cell(dense)} |" + " |" * (len(phases) - 1))
    for method in _order(table):
        lines.append(f"| {row_name(method)} | " + " | ".join(_cell(c) for c in table[method]) + " |")
    return "\n".join(lines)


def _achieved(run: dict, n: int) -> str:
    """The row under the header: what the final method's soups achieved (weights pruned; units removed)."""
    rows = _final_rows(run)[1][-n:]
    cells = ["-"] * (n - len(rows))
    for row in rows:
        units = "".join(f", {k} {100 * v:.1f}%" for k, v in (row.get("units") or {}).items())
        cells.append(f"weights {100 * row['sparsity']:.1f}%{units}" if isinstance(row.get("sparsity"), float) else "-")
    return "| achieved (final soup) | " + " | ".join(cells) + " |"


def _final_rows(run: dict) -> tuple[str, list[dict]]:
    """The method whose soup is the run's result, and its rows (older files: the first method)."""
    name = run.get("final_row") if run.get("final_row") in run["rows"] else next(iter(run["rows"]))
    return name, run["rows"][name]


def speedup_report(runs: list[dict]) -> str:
    """The speedups of the final method's soups after each phase, in FLOPs and as the sparse runtime measured them
    (mean over runs; "not measured" where no run timed them), then the final soup's measured record per run."""
    phases = runs[0]["phases"]
    name, _ = _final_rows(runs[0])
    flops: list[list[float]] = [[] for _ in phases]
    measured: list[list[float]] = [[] for _ in phases]
    for run in runs:
        rows = _final_rows(run)[1][-len(phases) :]
        for col, row in enumerate(rows, start=len(phases) - len(rows)):  # GMP/DPF without SMS: the last phase only
            if isinstance(row.get("speedup"), (int, float)):
                flops[col].append(row["speedup"])
            if (row.get("measured_speedup") or {}).get("speedup") is not None:
                measured[col].append(row["measured_speedup"]["speedup"])

    def cell(values: list[float], missing: str) -> str:
        return f"{statistics.mean(values):.2f}x" if values else missing

    lines = [
        f"| {row_name(name)}: speedup | " + " | ".join(f"phase {i + 1}" for i in range(len(phases))) + " |",
        "|" + "---|" * (len(phases) + 1),
        "| in FLOPs | " + " | ".join(cell(c, "-") for c in flops) + " |",
        "| measured | " + " | ".join(cell(c, "not measured") for c in measured) + " |",
        "",
    ]
    for run in runs:
        final = _final_rows(run)[1][-1].get("speedup")
        flops_final = f"{final:.2f}x" if isinstance(final, (int, float)) else "-"
        lines.append(
            f"final soup speedup: {flops_final} in FLOPs; measured: {format_measured(run.get('measured_speedup'))}"
        )
    return "\n".join(lines)


def save_results(results: dict | list[dict], path: str) -> None:
    """Write ``results`` as JSON atomically (temp file, then rename)."""
    with atomic_write(path) as f:
        json.dump(results, f, indent=2)


def reported_tests(run: dict) -> list[str]:
    """The named test sets a run reports ("test" alone for a run with one unnamed test set)."""
    first = next(iter(run["rows"].values()))[0]
    return list(first.get("tests") or {}) or ["test"]


def plot_results(runs: list[dict], path: str, splits: list[str] | None = None, ylabel: str = "metric") -> None:
    """PNG of each test metric vs sparsity (one panel per test set), one line per method, mean ± std over runs;
    the dense model is the dashed line. With pair soups (``pairwise_soups``) a last panel scatters each pair's soup
    against the better of its two ingredients on the first test set, one colour per phase (the paper's appendix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = splits or reported_tests(runs[0])
    phases = [100 * s for s in runs[0]["phases"]]
    pairs = pair_points(runs)
    panels = len(splits) + bool(pairs)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    if pairs:
        _scatter_pairs(axes[0][-1], pairs, ylabel)
    for ax, split in zip(axes[0], splits):
        dense = [value(r["dense"], split) for r in runs if r.get("dense") and value(r["dense"], split) is not None]
        if dense:
            ax.axhline(statistics.mean(dense), color="gray", linestyle="--", linewidth=1, label="dense (unpruned)")
        for method, cols in metric_table(runs, split).items():
            if not all(cols):
                continue
            means = [statistics.mean(c) for c in cols]
            stds = [statistics.stdev(c) if len(c) > 1 else 0.0 for c in cols]
            ax.errorbar(phases, means, yerr=stds, marker="o", capsize=3, label=row_name(method))
        ax.set_title(split)
        ax.set_xlabel("sparsity (%)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save_figure(fig, path)


def pair_points(runs: list[dict], test_set: str | None = None) -> dict[int, list[tuple[float, float]]]:
    """``{phase: [(the better of the two ingredients' test scores, the pair soup's), ...]}`` over every run's pair
    soups, as the paper's appendix scatters them: on the first test set, or on ``test_set`` (a name of ``tests``)."""
    points: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        for d in run.get("sms", []):
            for pair in d.get("pair_soups") or []:
                soup, scores = pair["test"], d["candidates_test"]
                if test_set is not None:
                    soup, scores = pair.get("tests", {}).get(test_set), d.get("candidates_tests", {}).get(test_set)
                ingredients = [scores[i] for i in pair["pair"]] if scores else [None]
                if soup is not None and None not in ingredients:
                    points.setdefault(d["phase"], []).append((max(ingredients), soup))
    return points


def _scatter_pairs(ax, pairs: dict[int, list[tuple[float, float]]], label: str) -> None:
    every = [v for points in pairs.values() for point in points for v in point]
    ax.plot([min(every), max(every)], [min(every), max(every)], color="gray", linestyle="--", linewidth=1)
    for phase, points in sorted(pairs.items()):
        ax.scatter(*zip(*points), s=18, label=f"phase {phase}")
    ax.set_title("pair soups (test)")
    ax.set_xlabel(f"better of the two ingredients, {label}")
    ax.set_ylabel(f"soup of the pair, {label}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def timeline(run: dict) -> list[dict]:
    """Per process of a run (its results.json ``world``): jobs trained, seconds training, seconds waiting for other
    groups, the rest (pruning, soups and evaluations, which the processes share) and the idle fraction."""
    world = run.get("world") or {}
    seconds, jobs = world.get("seconds"), world.get("jobs", [])
    if not seconds:
        raise ValueError(
            "this results.json records no schedule: it comes from a run that did not finish, or from "
            "hf-sms before 0.9; rerun (finished jobs are loaded, not retrained)"
        )
    out = []
    for rank in range(world.get("processes", 1)):
        mine = [j for j in jobs if j["rank"] == rank]
        train = sum(j["end"] - j["start"] for j in mine if j["kind"] == "train")
        wait = sum(j["end"] - j["start"] for j in mine if j["kind"] == "wait")
        group = next((j["group"] for j in mine), None)
        shared = max(seconds - train - wait, 0.0)
        out.append(
            {
                "rank": rank,
                "group": group,
                "jobs": sum(j["kind"] == "train" for j in mine),
                "train_s": round(train, 2),
                "wait_s": round(wait, 2),
                "shared_s": round(shared, 2),
                "idle": round(wait / seconds, 4),
            }
        )
    return out


def plot_timeline(run: dict, path: str) -> None:
    """PNG of the run's schedule: one lane per process, its training jobs (one colour per track) and its waits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    world = run["world"]
    tracks = sorted({j["job"].split("/")[0] for j in world["jobs"] if j["kind"] == "train"})
    colours = {t: plt.get_cmap("tab10")(k % 10) for k, t in enumerate(tracks)}
    fig, ax = plt.subplots(figsize=(10, 0.6 * world["processes"] + 1.5))
    for j in world["jobs"]:
        colour = colours[j["job"].split("/")[0]] if j["kind"] == "train" else "lightgray"
        ax.broken_barh([(j["start"], j["end"] - j["start"])], (j["rank"] - 0.4, 0.8), color=colour, edgecolor="white")
    handles = [Patch(color=c, label=t) for t, c in colours.items()]
    handles.append(Patch(color="lightgray", label="waiting for other groups"))
    ax.set_yticks(range(world["processes"]), [f"rank {r}" for r in range(world["processes"])])
    ax.set_xlim(0, world["seconds"])
    ax.set_xlabel("seconds since the run began (white: shared pruning, soups, evaluation)")
    ax.invert_yaxis()
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    _save_figure(fig, path)


# -- hf-sms table, hf-sms timeline (their arguments: hf_sms.cli) --------------------------------------------------
MAX_PROCESSES = 1 << 16


def _read(command: str, path: str) -> dict | None:
    """The run's results.json (``path``, or a run folder holding one), checked for what ``command`` reads; None
    after an error message."""
    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
    try:
        with open(path) as f:
            run = json.load(f)
        _check_results(run, command)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        print(
            f"hf-sms {command}: error: {path} is not a readable results.json ({e}); was its run killed while "
            "writing? Leave it out or rerun that run",
            file=sys.stderr,
        )
        return None
    except ValueError as e:
        print(f"hf-sms {command}: error: {path} is not the results.json of an hf-sms run: {e}", file=sys.stderr)
        return None
    return run


def _check_results(run, command: str) -> None:
    """What ``hf-sms table`` / ``timeline`` read, checked before they read it (a hand-edited or foreign JSON:
    transformers' all_results.json, a list)."""
    if not isinstance(run, dict):
        raise ValueError(f"it holds a JSON {type(run).__name__}, not an object")
    if command == "table":
        rows, phases = run.get("rows"), run.get("phases")
        if not isinstance(rows, dict) or not rows or not isinstance(phases, list):
            raise ValueError("it has no 'rows' and 'phases' (transformers' all_results.json has neither)")
        if not all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in phases):
            raise ValueError("'phases' must be a list of sparsities")
        if not all(isinstance(r, list) and r and all(isinstance(x, dict) for x in r) for r in rows.values()):
            raise ValueError("every entry of 'rows' must be a list of rows (objects), one per phase")
        return
    world = run.get("world")
    if world is None:
        return  # timeline() says the run recorded no schedule
    if not isinstance(world, dict):
        raise ValueError(f"'world' must be an object (processes, groups, jobs, seconds), got a {type(world).__name__}")
    n, jobs, groups = world.get("processes", 1), world.get("jobs", []), world.get("groups", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PROCESSES:
        raise ValueError(f"world.processes must be a count of processes from 1 to {MAX_PROCESSES}, got {n!r}")
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= n:
        raise ValueError(f"world.groups must be a count of process groups from 1 to processes={n}, got {groups!r}")
    keys = {"rank": int, "start": (int, float), "end": (int, float), "kind": str, "group": (int, type(None))}
    if not isinstance(jobs, list) or not all(
        isinstance(j, dict)
        and all(isinstance(j.get(k), t) for k, t in keys.items())
        and 0 <= j["rank"] < n
        and (j["kind"] != "train" or isinstance(j.get("job"), str))
        for j in jobs
    ):
        raise ValueError(
            f"world.jobs must be records with rank (below processes={n}), group, start, end, kind (and a train "
            "job's name)"
        )
    if not isinstance(world.get("seconds", 0), (int, float)):
        raise ValueError("world.seconds must be a number")


def table(args) -> int:
    """``hf-sms table RESULTS... [--split ...]``."""
    runs = [_read("table", path) for path in args.results]
    if None in runs:
        return 2
    for split in args.split or reported_tests(runs[0]):
        print(f"{split}:\n{format_table(runs, split)}\n")
    print(speedup_report(runs))
    return 0


def timeline_command(args) -> int:
    """``hf-sms timeline RUN_DIR``."""
    run = _read("timeline", os.path.join(args.run_dir, "results.json"))
    if run is None:
        return 2
    try:
        rows = timeline(run)
    except ValueError as e:
        print(f"hf-sms timeline: error: {e}", file=sys.stderr)
        return 2
    world = run["world"]
    groups, seconds = world.get("groups", 1), world.get("seconds", 0.0)
    print(f"{world['processes']} process(es) in {groups} group(s), {seconds:.1f} s")
    print(f"{'rank':>4} {'group':>5} {'jobs':>4} {'training s':>10} {'waiting s':>9} {'shared s':>8} {'idle':>6}")
    for r in rows:
        print(
            f"{r['rank']:>4} {r['group'] if r['group'] is not None else '-':>5} {r['jobs']:>4} {r['train_s']:>10.1f} "
            f"{r['wait_s']:>9.1f} {r['shared_s']:>8.1f} {100 * r['idle']:>5.1f}%"
        )
    picture = os.path.join(args.run_dir, "timeline.png")
    plot_timeline(run, picture)
    print(f"wrote {picture}")
    return 0


def _save_figure(fig, path: str) -> None:
    """``fig`` as a PNG at ``path``, written atomically; closed either way."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
    finally:
        plt.close(fig)

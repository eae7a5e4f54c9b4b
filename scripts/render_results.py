"""Renders the speed tables of README.md and of the shipped drafter's model card from `longspark bench speed --json`
reports, so that each figure is written in one place: the JSON of one benchmark run.

    python scripts/render_results.py                      # re-render both from the reports README.md's marker names
    python scripts/render_results.py SHORT.json LONG.json   # switch both to these reports, then render
    python scripts/render_results.py --check              # exit 1 if a file is not what its reports give

README.md holds the table between `<!-- results:begin REPORT.json ... -->` and `<!-- results:end -->`; the marker
names the reports. The model card (`src/transformers_longspark/drafters/NAME/README.md`, written by `longspark card`)
gets its "Measured" section re-rendered from the same reports, as `longspark card` writes it. Any other table of
README.md, the card or `docs/*.md` sits between `<!-- table:begin REPORT.json -->` and `<!-- table:end -->` and is
rendered from that one report (`bench tau`, with or without `--by-length`, the long-range ablation, and
`examples/serve_vllm.py --json`).
`tests/test_docs.py` runs the check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CARD = ROOT / "src" / "transformers_longspark" / "drafters" / "longspark-smollm2-135m-instruct" / "README.md"
DOCS = ROOT / "docs"

BEGIN = re.compile(r"<!-- results:begin(?P<reports>[^>]*)-->\n")
END = "<!-- results:end -->"
PLAIN_METHODS = ("plain", "plain_fast", "plain_static")
MODES = {"greedy": "greedy", "sampled": "T=1"}
PLAIN_LABELS = {"plain": "plain", "plain_fast": "fast path", "plain_static": "static cache"}
# Column headers of the attribution methods (the reports' own labels are longer).
SHORT_LABELS = {
    "longspark_drafter_only": "drafter alone",
    "longspark_drafter_planned": "drafter alone, lengths planned",
    "longspark_lookup_only": "lookup alone",
    "longspark_no_proposals": "no proposals (plain steps)",
    "prompt_lookup_fast": "prompt lookup",
}


def read_report(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(report, dict) or report.get("benchmark") != "speed":
        raise SystemExit(f"{path} is not a `longspark bench speed --json` report (its 'benchmark' field).")
    return report


def _workload(report: dict[str, Any], name: str) -> str:
    prompts = report.get("workloads", {}).get(name, {}).get("prompts", [])
    if not prompts:
        return name
    lengths = sorted(p["prompt_tokens"] for p in prompts)
    tokens = f"{lengths[0]:,}" if lengths[0] == lengths[-1] else f"{lengths[0]:,}-{lengths[-1]:,}"
    kind = "long code" if name == "long" else "short prompts" if name == "short" else name
    return f"{kind} ({len(prompts)} held-out, {tokens} tokens)"


def _tps(row: dict[str, Any] | None) -> str:
    return "-" if row is None or row.get("decode_tokens_per_s") is None else f"{row['decode_tokens_per_s']:.1f}"


def _ratio(value: float | None, bold: bool = False) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}x"
    return f"**{text}**" if bold and value > 1.0 else text


def readme_table(reports: list[dict[str, Any]]) -> str:
    """One row per workload and mode: decode tokens/s of each method, LongSpark's tau and its speed-ups."""
    methods: list[str] = []
    for report in reports:
        for row in report["rows"]:
            if row["method"] not in methods and row["method"] not in PLAIN_METHODS and row["method"] != "longspark":
                methods.append(row["method"])
    rows = [row for report in reports for row in report["rows"]]
    labels = {row["method"]: SHORT_LABELS.get(row["method"], row["label"]) for row in rows}
    header = ["workload", "mode", "plain `generate`", "best plain path", *(labels[m] for m in methods), "**LongSpark**",
              "LongSpark tau", "LongSpark vs plain", "vs best plain", "identical to plain"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 3) + "---|"]
    for report in reports:
        cases = dict.fromkeys((row["workload"], row["mode"]) for row in report["rows"])
        for workload, mode in cases:
            rows = {r["method"]: r for r in report["rows"] if (r["workload"], r["mode"]) == (workload, mode)}
            ours = rows.get("longspark")
            if ours is None:
                raise SystemExit(f"{report.get('command')}: no `longspark` row for {workload} {mode}.")
            best = rows.get(ours.get("best_plain_decode"))
            best_cell = "-" if best is None else f"{_tps(best)} ({PLAIN_LABELS.get(best['method'], best['label'])})"
            identical = {True: "yes", False: "**NO**"}.get(ours.get("greedy_identical"), "-")
            cells = [_workload(report, workload), MODES.get(mode, mode), _tps(rows.get("plain")), best_cell,
                     *(_tps(rows.get(m)) for m in methods), f"**{_tps(ours)}**", f"{ours['tau']:.2f}",
                     _ratio(ours.get("decode_speedup"), bold=True),
                     _ratio(ours.get("decode_speedup_vs_best_plain"), bold=True), identical]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    machine = reports[0].get("machine", {})
    lines += [
        "",
        "Decode tokens/s (the tokens after the first over the time after the prefill, which every method spends "
        "alike); best plain path: the fastest plain decoding of the same run; tau: tokens per verification round, "
        "plain steps included; identical: greedy outputs equal plain `generate`'s (sampled ones are exact in "
        f"distribution). Measured on {machine.get('cpu', 'an unknown CPU')} ({machine.get('cpu_cores', '?')} cores, "
        f"{machine.get('torch_threads', '?')} torch threads, {machine.get('device', 'cpu')}), torch "
        f"{machine.get('torch', '?')}, transformers {machine.get('transformers', '?')}; every method interleaved "
        "prompt by prompt in one run. Commands:",
        "",
        "```bash",
        *(report.get("command", "longspark bench speed") for report in reports),
        "```",
    ]
    return "\n".join(lines)


def readme_reports(text: str) -> list[Path]:
    match = BEGIN.search(text)
    if match is None or END not in text[match.end() :]:
        raise SystemExit(f"{README} has no `<!-- results:begin REPORT.json -->` ... `{END}` block.")
    paths = [ROOT / p for p in match.group("reports").split()]
    if not paths:
        raise SystemExit(f"{README}'s results marker names no report.")
    return paths


def render_readme(text: str, paths: list[Path]) -> str:
    match = BEGIN.search(text)
    end = text.index(END, match.end())
    names = " ".join(p.relative_to(ROOT).as_posix() for p in paths)
    table = readme_table([read_report(p) for p in paths])
    return f"{text[: match.start()]}<!-- results:begin {names} -->\n{table}\n{text[end:]}"


def render_card(text: str, paths: list[Path]) -> str:
    """The card's "Measured" section as `longspark card` writes it (`model_card.py`), from `paths`."""
    from transformers_longspark.model_card import _machine, _results_table

    reports = [read_report(p) for p in paths]
    commands = "\n".join(report.get("command", "longspark bench") for report in reports)
    section = f"{_results_table(reports)}\n\nMeasured with:\n\n```bash\n{commands}\n```\n\n{_machine(reports[0])}"
    start, end = text.index("## Measured\n\n") + len("## Measured\n\n"), text.index("\n\n## Training")
    return text[:start] + section + text[end:]


TABLE = re.compile(r"<!-- table:begin (?P<report>\S+) -->\n(?P<table>.*?)<!-- table:end -->", re.DOTALL)


def report_table(path: Path) -> str:
    """The Markdown table of one benchmark report, by its 'benchmark' field (`bench tau`, batches, training curves,
    the long-range ablation, ...)."""
    from transformers_longspark.benchmarks.batched import format_batched
    from transformers_longspark.benchmarks.tau import format_tau, format_tau_curve
    from transformers_longspark.experiments.needle_recall import format_ablation

    report = json.loads(path.read_text(encoding="utf-8"))
    kind = report.get("benchmark") if isinstance(report, dict) else None
    if kind == "tau":
        by_length = any("@" in row["workload"] for row in report["rows"])
        return (format_tau_curve if by_length else format_tau)(report)
    if kind == "long_range_ablation":
        return format_ablation(report)
    if kind == "vllm_example":
        return vllm_example_table(report)
    if kind == "regeneration_throughput":
        return regeneration_table(report)
    if kind == "drafter_round_parts":
        return round_parts_table(report)
    if kind == "speed":
        return speed_rows_table(report)
    if kind == "training_curve":
        return training_curve_table(report)
    if kind == "recipe_campaign":
        return recipe_campaign_table(report)
    if kind == "training_campaign":
        return training_campaign_table(report)
    if kind == "batched":
        return format_batched(report)
    if kind == "teacher_forced_tau":
        return teacher_forced_tau_table(report)
    if kind == "verify_roofline":
        return verify_roofline_table(report)
    if kind == "fused_projections_ab":
        return fused_projections_table(report)
    if kind == "planner_replay":
        spec = importlib.util.spec_from_file_location("planner_replay", ROOT / "scripts" / "planner_replay.py")
        module = sys.modules.setdefault("planner_replay", importlib.util.module_from_spec(spec))
        spec.loader.exec_module(module)
        return module.format_table(report)
    raise SystemExit(f"{path}: no table for a report of kind {kind!r} (its 'benchmark' field).")


def vllm_example_table(report: dict[str, Any]) -> str:
    """The table `examples/serve_vllm.py --json` prints: each engine on the same two requests."""
    labels = {"plain": "plain vLLM", "ngram": "vLLM n-gram", "longspark": "vLLM + LongSpark"}
    lines = ["| engine | identical to plain | tokens/s | speedup | tau |", "|---|---|---:|---:|---:|"]
    for method, row in report["engines"].items():
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        identical = "yes" if row["identical_to_plain"] else "**NO**"
        lines.append(f"| {labels.get(method, method)} | {identical} | {row['tokens_per_s']:.1f} | "
                     f"{row['speedup']:.2f}x | {tau} |")  # fmt: skip
    settings, machine = report.get("settings", {}), report.get("machine", {})
    lines += ["", f"Two requests served together (a chat question and a {settings.get('long_prompt_tokens')}-token "
              f"held-out stdlib file), greedy, {settings.get('max_tokens')} new tokens each, {settings.get('dtype')}; "
              f"{machine.get('cpu', 'an unknown CPU')}, torch {machine.get('torch', '?')}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]], note: str, text_columns: int = 1) -> str:
    """A Markdown table (the first `text_columns` left-aligned, the rest right-aligned) and its note."""
    align = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
    lines = [f"| {' | '.join(cells)} |" for cells in (header, *rows)]
    lines.insert(1, f"|{'|'.join(align)}|")
    return "\n".join([*lines, "", note]) + "\n"


def regeneration_table(report: dict[str, Any]) -> str:
    """The table `scripts/regeneration_throughput.py --json` prints: each engine on the same prompts."""
    runs, machine = report["runs"], report.get("machine", {})
    baseline = max(row["tokens_per_s"] for row in runs if row["engine"] == "transformers")
    rows = [[row["engine"], row["dtype"], str(row["batch_size"]), f"{row['response_tokens']:,}",
             f"{row['seconds']:.0f}", f"{row['tokens_per_s']:.0f}", f"{row['tokens_per_s'] / baseline:.2f}x"]
            for row in runs]  # fmt: skip
    note = (f"{report['num_prompts']} prompts (gsm8k, mmath-en, stdlib-code), sampled (T=0.7, top-k 20, top-p 0.8), "
            f"at most {report['max_new_tokens']} new tokens each; transformers at "
            f"{runs[0].get('torch_threads', '?')} threads; {machine.get('cpu', 'an unknown CPU')} "
            f"({machine.get('cpu_cores', '?')} cores), torch {machine.get('torch', '?')}.")  # fmt: skip
    header = ["engine", "dtype", "batch", "response tokens", "seconds", "tokens/s", "vs transformers"]
    return _table(header, rows, note, text_columns=2)


def speed_rows_table(report: dict[str, Any]) -> str:
    """Every row of a `longspark bench speed` report: decode speed against plain `generate` and the best plain path,
    tau, what proposing costs per round, and greedy identity."""
    machine = report.get("machine", {})
    rows = [[row["workload"], row["mode"], row["label"], f"{row['tau']:.2f}", f"{row['decode_tokens_per_s']:.1f}",
             f"{row['decode_speedup']:.2f}x", f"{row['decode_speedup_vs_best_plain']:.2f}x",
             "-" if row.get("proposal_ms_per_round") is None else f"{row['proposal_ms_per_round']:.1f}",
             "-" if row["mode"] != "greedy" else ("yes" if row.get("greedy_identical") else "NO")]
            for row in report["rows"]]  # fmt: skip
    note = (f"{machine.get('cpu', 'an unknown CPU')} ({machine.get('cpu_cores', '?')} cores, "
            f"{machine.get('torch_threads', '?')} threads), torch {machine.get('torch', '?')}; every method "
            f"interleaved per prompt; variants: {json.dumps(report['settings'].get('variants', {}))}.")  # fmt: skip
    header = ["workload", "mode", "method", "tau", "decode tok/s", "vs plain", "vs best plain", "propose ms/round",
              "identical"]  # fmt: skip
    return _table(header, rows, note, text_columns=3)


def round_parts_table(report: dict[str, Any]) -> str:
    """The table `scripts/drafter_round_parts.py --json` prints: a drafter round by part, per linear dtype."""
    machine = report.get("machine", {})
    rows = [[row["dtype"].removeprefix("torch."), *(f"{row[k]:.2f}" for k in
             ("drafter_forward", "context_read", "planning", "rest", "total")), f"{row['round_steps']:.3f}",
             f"{row['tau']:.2f}"] for row in report["settings"].values()]  # fmt: skip
    note = (f"Drafter alone on {report['prompts']} held-out short prompts, greedy; a plain step on the fast path "
            f"took {report['plain_step_ms']:.1f} ms; {machine.get('cpu', 'an unknown CPU')}, "
            f"{machine.get('torch_threads', '?')} threads, torch {machine.get('torch', '?')}.")  # fmt: skip
    header = ["linear dtype", "drafter forward", "context read", "planning", "rest", "round (ms)", "in target steps",
              "tau"]  # fmt: skip
    return _table(header, rows, note)


def training_curve_table(report: dict[str, Any]) -> str:
    """The table `scripts/training_curve.py --json` prints: each checkpoint's held-out tau and tokens per step
    against the CPU time that trained it."""
    workloads, machine = report["workloads"], report.get("machine", {})
    rows = [[str(row["step"]), f"{row['cpu_hours']:.2f}", f"{row['target_tokens']:,}",
             *(f"{row[w]['tau']:.3f} / {row[w]['tokens_per_step']:.3f}" for w in workloads)]
            for row in report["rows"]]  # fmt: skip
    threads = ", ".join(f"{count} from step {step}" for step, count in report["threads"].items())
    note = (f"Held-out greedy tau / tokens per target step of the drafter alone (lookup off, costs 0), each checkpoint "
            f"in one `longspark bench tau` run; CPU-hours: the run's wall seconds times its torch threads ({threads}); "
            f"{machine.get('cpu', 'an unknown CPU')}, torch {machine.get('torch', '?')}.")  # fmt: skip
    header = ["step", "CPU-hours", "target tokens", *(f"{w}: tau / tokens per step" for w in workloads)]
    return _table(header, rows, note)


def recipe_campaign_table(report: dict[str, Any]) -> str:
    """The table `scripts/recipe_campaign_table.py --json` prints: each arm's change, training CPU time, and held-out
    tau, tokens per target step and drafter round price per workload."""
    workloads, machine = report["workloads"], report.get("machine", {})

    def cells(entry: dict[str, Any] | None) -> list[str]:
        if entry is None:
            return ["-", "-"]
        return [f"{entry['tau']:.3f} / {entry['tokens_per_step']:.3f}", f"{entry['draft_round_cost']:.3f}"]

    rows = [[f"`{row['arm']}`", row["change"], f"{row['cpu_hours']:.2f}",
             *(cell for w in workloads for cell in cells(row.get(w)))] for row in report["rows"]]  # fmt: skip
    start = report.get("start") or {}
    if start:
        rows.insert(0, ["start", report.get("start_label", "the drafter every arm starts from"), "0.00",
                        *(cell for w in workloads for cell in cells(start.get(w)))])  # fmt: skip
    note = (f"Each arm trains {report['step']} steps of the reference recipe `{report['reference']}` with the change "
            f"shown; held-out greedy tau / tokens per target step of the drafter alone (lookup off; tokens per step "
            f"prices each round at the drafter's calibrated round cost, in target steps), all arms in one `longspark "
            f"bench tau` run per workload; CPU-hours: the median step's wall seconds x steps x torch threads; "
            f"{machine.get('cpu', 'an unknown CPU')}, torch {machine.get('torch', '?')}.")  # fmt: skip
    header = ["arm", "change", "CPU-hours",
              *(h for w in workloads for h in (f"{w}: tau / tokens per step", f"{w}: round (steps)"))]  # fmt: skip
    return _table(header, rows, note, text_columns=2)


def training_campaign_table(report: dict[str, Any]) -> str:
    """The table `scripts/campaign_curve.py --json` prints: each shipped stage's held-out teacher-forced tau against
    the training CPU time and target tokens spent since the first stage listed."""
    rows = [[f"`{row['stage']}`", str(row["steps"]), f"{row['cpu_hours']:.1f}", f"{row['target_tokens'] / 1e6:.2f}M",
             f"{row['code']['tau']:.3f} ({row['code']['tau'] - row['code']['start_tau']:+.3f})",
             f"{row['code']['first_accepted']:.3f}",
             f"{row['chats']['tau']:.3f} ({row['chats']['tau'] - row['chats']['start_tau']:+.3f}, "
             f"{row['chats']['records']})"] for row in report["rows"]]  # fmt: skip
    slowed = sum(row["slowed_steps"] for row in report["rows"])
    note = (f"Teacher-forced whole-block greedy tau of each shipped stage alone (in brackets: its gain over the "
            f"drafter it continued, scored in the same run); code: the 40 held-out code continuations, chats: the "
            f"held-out greedy chats (how many in brackets: all 120, or the first 40); CPU-hours: training's logged "
            f"wall seconds times {report['threads']} threads ({slowed} steps slowed by paused or concurrent work "
            f"counted at their stage's median step).")  # fmt: skip
    header = ["stage", "steps", "CPU-hours", "target tokens", "code: tau (gain)", "code: P(accepted >= 1)",
              "chats: tau (gain, records)"]  # fmt: skip
    return _table(header, rows, note)


def teacher_forced_tau_table(report: dict[str, Any]) -> str:
    """The table `scripts/teacher_forced_tau.py --json` prints: each drafter's chained whole-block greedy tau on
    held-out greedy records, overall and per prompt source, and how often each slot is reached."""
    drafters, machine = report["drafters"], report.get("machine", {})
    sources = sorted({k for row in drafters.values() for k in row} - {"path", "all"})
    rows = [[f"`{name}`", *(f"{row[k]['tau']:.3f}" for k in ("all", *sources)),
             " / ".join(f"{rate:.3f}" for rate in row["all"]["acceptance_rates"][:3])]
            for name, row in drafters.items()]  # fmt: skip
    anchors = next(iter(drafters.values()))["all"]["anchors"]
    note = (f"Whole-block greedy tau of each drafter alone, teacher-forced on the {report['num_records']} greedy "
            f"records of `{report['records']}` ({anchors:,} anchors), rounds chained from each response's first "
            f"token; P(accepted >= i) over every anchor; fp32; {machine.get('cpu', 'an unknown CPU')}, torch "
            f"{machine.get('torch', '?')}.")  # fmt: skip
    header = ["drafter", "tau", *(f"{s}: tau" for s in sources), "P(accepted >= 1 / 2 / 3)"]
    return _table(header, rows, note)


def verify_roofline_table(report: dict[str, Any]) -> str:
    """The table `scripts/verify_roofline.py --json` prints: each fast-path verification forward against the time its
    linear layers and attention need at the machine's measured peaks."""
    peaks, machine = report["peaks"], report.get("machine", {})
    rows = [[f"{row['prefix']:,}", str(row["k"]), f"{row['measured_ms']:.1f}",
             *(f"{row[part]['measured_ms']:.1f} / {row[part]['floor_ms']:.1f} ({row[part]['bound']})"
               for part in ("linear", "attention")),
             f"{row['rest']['measured_ms']:.1f}", f"{row['measured_ms'] / row['floor_ms']:.2f}x"]
            for row in report["rows"]]  # fmt: skip
    note = (f"Fast-path forwards of `{report['verify_cost']}` (median ms), split by part in the shares of a profiled "
            f"forward; floors at the peaks measured in the same run: {peaks['gflops']:.0f} GFLOP/s fp32 (a 2048-square "
            f"`mm`), {peaks['gbytes_per_s']:.1f} GB/s (a matrix-vector product over 512 MiB); what bounds each floor "
            f"in brackets; {machine.get('cpu', 'an unknown CPU')}, "
            f"{machine.get('torch_threads', '?')} threads, torch {machine.get('torch', '?')}.")  # fmt: skip
    header = ["prefix", "k", "forward ms", "linear: ms / floor", "attention: ms / floor", "rest ms",
              "forward / floors"]  # fmt: skip
    return _table(header, rows, note)


def fused_projections_table(report: dict[str, Any]) -> str:
    """The table `scripts/fused_projections_ab.py --json` prints: fast-path forwards with one packed product per
    projection against one per set of projections that read the same input."""
    machine = report.get("machine", {})
    rows = [[f"{row['prefix']:,}", str(row["k"]), f"{row['separate_ms']:.1f}", f"{row['fused_ms']:.1f}",
             f"{row['fused_ms'] / row['separate_ms']:.2f}x", "yes" if row["identical"] else "NO"]
            for row in report["rows"]]  # fmt: skip
    note = (f"Median of {report['repeats']} forwards each, the two interleaved; "
            f"{machine.get('cpu', 'an unknown CPU')}, {machine.get('torch_threads', '?')} threads, "
            f"torch {machine.get('torch', '?')}.")  # fmt: skip
    header = ["prefix", "k", "one product per projection (ms)", "q/k/v and gate/up fused (ms)", "fused / separate",
              "logits identical"]  # fmt: skip
    return _table(header, rows, note)


def render_tables(text: str) -> str:
    """Re-renders every `<!-- table:begin REPORT.json -->` ... `<!-- table:end -->` block from its report."""

    def table(match: re.Match) -> str:
        report = match.group("report")
        return f"<!-- table:begin {report} -->\n{report_table(ROOT / report)}<!-- table:end -->"

    return TABLE.sub(table, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="*", type=Path, help="speed reports to render from (default: README's)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file differs")
    args = parser.parse_args(argv)
    readme = README.read_text(encoding="utf-8")
    paths = [p.resolve() for p in args.reports] or readme_reports(readme)
    stale = []
    renders = [(README, render_readme), (CARD, render_card)] + [(doc, None) for doc in sorted(DOCS.glob("*.md"))]
    for path, render in renders:
        text = path.read_text(encoding="utf-8")
        rendered = render_tables(text if render is None else render(text, paths))
        if rendered != text:
            stale.append(path.relative_to(ROOT).as_posix())
            if not args.check:
                path.write_text(rendered, encoding="utf-8")
    if args.check and stale:
        print(f"Not rendered from their reports: {', '.join(stale)}; run python scripts/render_results.py")
        return 1
    print(("Rewrote: " + ", ".join(stale)) if stale and not args.check else "Up to date.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

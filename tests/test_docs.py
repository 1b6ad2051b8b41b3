"""The README's "In one screen" block runs as written, and the values its comments state are the real ones
(``run.logits[0].shape`` is ``[3, 622]``: a comment that states a shape must state the one that comes).
"""

from __future__ import annotations

import ast
import linecache
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

README = Path(__file__).resolve().parents[1] / "README.md"


def _screen() -> str:
    text = README.read_text()
    part = text.split("## In one screen", 1)[1]
    return re.search(r"```python\n(.*?)```", part, re.S).group(1)


def test_readme_block_runs_and_its_stated_values_are_true():
    code = _screen()
    line = next(ln for ln in code.splitlines() if ln.startswith("run.text, run.logits[0].shape"))
    stated = ast.literal_eval(line.split("#", 1)[1].split(":", 1)[0].strip())
    scope: dict = {}
    try:
        name = "<README.md: In one screen>"
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # nnsight reads `with` bodies back
        exec(compile(code, name, "exec"), scope)  # noqa: S102 - our own README
        run = scope["run"]
        got = (run.text, list(run.logits[0].shape), list(run.resid[0].shape))
        assert got == tuple(stated), f"README states {stated}, the toy model gives {got}"
        line = next(ln for ln in code.splitlines() if ln.startswith("steered.text"))
        stated_steer = ast.literal_eval(line.split("#", 1)[1].split(":", 1)[0].strip())
        assert scope["steered"].text == stated_steer, (stated_steer, scope["steered"].text)
    finally:
        for name in ("other", "model"):
            m = scope.get(name)
            if m is not None:
                m.close()


def _md_rows(text: str, after: str) -> list[list[str]]:
    """The cells of the first markdown table after the line containing ``after``."""
    head, tail = text.split(after, 1)
    lines = (head.rsplit("\n", 1)[-1] + after + tail).splitlines()  # from the line containing it
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def test_the_gpu_cost_tables_in_docs_capture_are_their_recorded_runs():
    """docs/capture.md's H200 tables state the seconds and ratios of the runs they name, as
    ``benchmarks/capture_gpu.py --table`` renders them from ``benchmarks/results/capture_gpu_h200.json``."""
    import json
    import statistics
    import subprocess
    import sys

    root = README.parent
    results = root / "benchmarks" / "results" / "capture_gpu_h200.json"
    runs = json.loads(results.read_text())["runs"]
    doc = (root / "docs" / "capture.md").read_text()
    tool = subprocess.run([sys.executable, str(root / "benchmarks" / "capture_gpu.py"), "--table", "llama1b_defaults",
                           "--out", str(results)], capture_output=True, text=True, check=True).stdout
    rendered = {r[0].strip("`"): r[1:] for r in _md_rows(tool, "x bare_graphs")}
    # The doc's rows, in order, are these cases of the run.
    cases = ["bare_graphs", "nv_default", "nv_default_tokens", "nv_graphs", "nv_graphs_tokens", "nv_graphs_bare",
             "nv_graphs_nopieces", "nv_graphs_nopieces_tokens", "nv_graphs_nopieces_bare", "bare_nocompile"]
    doc_rows = _md_rows(doc, "run `llama1b_defaults`")
    assert [r[1:] for r in doc_rows] == [rendered[c] for c in cases], (doc_rows, rendered)
    # The spreads the text states are the run's.
    every = runs["llama1b_defaults"]["all"]
    for case, lo, hi in (("bare_graphs", 0.78, 1.21), ("nv_default", 0.88, 1.30), ("bare_nocompile", 0.94, 1.08)):
        med = statistics.median(every[case])
        assert (round(min(every[case]) / med, 2), round(max(every[case]) / med, 2)) == (lo, hi), case
        assert f"{lo:.2f}x to {hi:.2f}x" in " ".join(doc.split()), case
    # The GPT-2-small table and its spreads.
    tool = subprocess.run([sys.executable, str(root / "benchmarks" / "capture_gpu.py"), "--table", "gpt2s",
                           "--out", str(results)], capture_output=True, text=True, check=True).stdout
    rendered = {r[0].strip("`"): r[1:] for r in _md_rows(tool, "x bare_graphs")}
    cases = ["bare_graphs", "nv_default", "nv_default_tokens", "nv_graphs", "nv_graphs_tokens", "nv_graphs_bare"]
    assert [r[1:] for r in _md_rows(doc, "run\n`gpt2s`")] == [rendered[c] for c in cases], rendered
    every = runs["gpt2s"]["all"]
    for case, lo, hi in (("nv_default", 0.94, 1.09), ("bare_graphs", 0.81, 1.22)):
        med = statistics.median(every[case])
        assert (round(min(every[case]) / med, 2), round(max(every[case]) / med, 2)) == (lo, hi), case
        assert f"{lo:.2f}x to {hi:.2f}x" in " ".join(doc.split()), case
    # The trace table (H100 runs, with the ring and without): each cell is its case's seconds (and its
    # ratio to nv.generate in the same run).
    h100 = json.loads((root / "benchmarks" / "results" / "capture_gpu_h100_80gb_hbm3.json").read_text())["runs"]
    ring, before = h100["llama1b_trace_ring"]["seconds"], h100["llama1b_trace_seams"]["seconds"]
    rows = _md_rows(doc, "--cases nv_trace`")
    assert [r[0] for r in rows] == ["1", "8", "64"], rows
    for row in rows:
        k = row[0]
        for s, cells in ((ring, row[1:4]), (before, row[4:6])):
            gen = s[f"nv_trace_{k}_generate"]
            assert cells[0] == f"{gen:.3f} s", row
            for cell, case in zip(cells[1:], (f"nv_trace_{k}", f"nv_trace_{k}_logits_only")):
                assert cell == (f"{s[case]:.3f} s ({s[case] / gen:.1f}x)" if case in s else ""), (row, case)
    # The second run of the same code, in the text: its seconds, ratios and the steps' host time.
    flat = " ".join(doc.split())
    again, first = h100["llama1b_trace_ring_2"], h100["llama1b_trace_ring"]
    s = again["seconds"]
    assert again["code"] == first["code"], (again["code"], first["code"])
    fastest = min(again["all"]["nv_trace_1"]) / min(again["all"]["nv_trace_1_generate"])
    assert (f"took {s['nv_trace_1_generate']:.3f} / {s['nv_trace_1']:.3f} s for `nv.generate` / the trace of every "
            f"block with 1 prompt ({s['nv_trace_1'] / s['nv_trace_1_generate']:.2f}x; fastest calls {fastest:.2f}x), "
            f"{s['nv_trace_8_generate']:.3f} / {s['nv_trace_8']:.3f} s with 8 "
            f"({s['nv_trace_8'] / s['nv_trace_8_generate']:.1f}x) and {s['nv_trace_64_generate']:.3f} / "
            f"{s['nv_trace_64']:.3f} s with 64 ({s['nv_trace_64'] / s['nv_trace_64_generate']:.1f}x)") in flat

    def steps(run: dict, case: str) -> str:
        return f"{statistics.median(c['step_seconds'] for c in run['per_call'][case]):.3f}"
    assert (f"was {steps(again, 'nv_trace_1_logits_only')} s there against {steps(first, 'nv_trace_1_logits_only')} s "
            f"in run `llama1b_trace_ring`, and in the trace of every block {steps(again, 'nv_trace_1')} s against "
            f"{steps(first, 'nv_trace_1')} s") in flat
    iso = h100["llama1b_trace_isolated"]["seconds"]
    stated = [" / ".join(f"{iso[f'nv_trace_isolated_{k}{suffix}']:.3f}" for k in (1, 8, 64)) for suffix in ("", "_generate")]
    assert (f"took {stated[0]} s for 1 / 8 / 64 prompts, against `nv.generate`'s {stated[1]} s"
            in " ".join(doc.split())), stated


def test_the_paired_cost_table_in_docs_capture_is_its_recorded_run():
    """docs/capture.md's paired table (bare vLLM, vLLM under nnvllm's settings and nnvllm's engines
    called in turns on the H200) states run ``llama1b_paired_split``'s seconds, ratios, intervals and
    spreads as ``--table`` renders them; the text's steps of the gap, per-call medians and hand-off
    times are those of its calls, and the intervals it says hold 1.0 do."""
    import json
    import statistics
    import subprocess
    import sys

    root = README.parent
    doc = (root / "docs" / "capture.md").read_text()
    flat = " ".join(doc.split())
    results = root / "benchmarks" / "results" / "capture_gpu_h200.json"
    tool = subprocess.run([sys.executable, str(root / "benchmarks" / "capture_gpu.py"), "--table", "llama1b_paired_split",
                           "--out", str(results)], capture_output=True, text=True, check=True).stdout
    rendered = [r[1:] for r in _md_rows(tool, "x bare, per turn")]
    assert [r[1:] for r in _md_rows(doc, "run `llama1b_paired_split` in\n`benchmarks/results/capture_gpu_h200.json`")] == rendered
    run = json.loads(results.read_text())["runs"]["llama1b_paired_split"]
    assert f"`{run['command'].replace(' --timeout 500 --root /tmp/nnvllm-bench', '')}`" in flat
    assert run["repeats"] == 24 and "the 7th and the 18th of the 24 ratios" in flat
    summary = run["seconds"]["paired_split_summary"]
    for form in ("settings", "own"):
        lo, hi = summary[f"interval x bare {form}"]
        assert lo < 1.0 < hi, form
    assert (f"the in-process capture took {summary['x own in_process']:.2f}x the same engine's own generate, and "
            f"the isolated one {summary['x in_process default']:.2f}x the in-process capture") in flat
    st = _fastest_steps(run["all"], "paired_split")
    assert (f"The fastest calls tell the steps apart: {st[0]:.2f}x for the settings, {st[1]:.2f}x more for nnvllm's "
            f"engine with nothing captured (nnsight's runner, nnvllm's taps), {st[2]:.2f}x more for the capture and "
            f"{st[3]:.2f}x more for the isolation, {st[4]:.2f}x in all.") in flat, st
    calls = run["per_call"]["paired_split_in_process"]
    med = {k: statistics.median(c[k] for c in calls) for k in ("client_generate", "client_collect", "handover_copy")}
    built = statistics.median(c["client_request"] + c["client_assemble"] for c in calls)
    assert (f"the generation {med['client_generate']:.3f} s" in flat and f"the collection {med['client_collect']:.3f} s" in flat
            and f"takes {med['handover_copy']:.3f} s" in flat and f"`Run`, {built:.3f} s" in flat), (med, built)
    rate = statistics.median(c["handover_bytes"] / c["handover_copy"] for c in calls) / 1e9
    share = med["handover_copy"] / run["seconds"]["paired_split_bare"]
    assert f"takes {med['handover_copy']:.3f} s ({rate:.0f} GB/s), {100 * share:.1f}% of bare vLLM's call" in flat, (rate, share)
    adds = statistics.median(c["client_server_add"] for c in run["per_call"]["paired_split_default"])
    assert f"adds the 64 requests ({adds:.3f} s)" in flat
    both = [c for cs in run["per_call"].values() for c in cs]
    hs = [c["handover"] for c in both]
    assert len(both) == 48 and f"over the {len(both)} capturing calls the hand-off took {min(hs):.3f} to {max(hs):.3f} s" in flat.lower()
    for cs in run["per_call"].values():
        assert [c["files_made"] for c in cs[1:]] == [0] * (len(cs) - 1)
    assert {c["handover_bytes"] for c in both} == {738754560} and "(738 MB)" in flat


def test_the_cpu_engine_cost_in_docs_capture_is_its_recorded_run():
    """docs/capture.md's ratios of the engine's own generate and of nv.generate to plain vLLM on the
    CPU are those of run ``64x64 L2 d64``, and the command it gives is the run's."""
    import json

    root = README.parent
    flat = " ".join((root / "docs" / "capture.md").read_text().split())
    run = json.loads((root / "benchmarks" / "results" / "capture_cpu.json").read_text())["runs"]["64x64 L2 d64"]
    s = run["seconds"]
    plain = s["plain vLLM, no nnsight"]
    own, every = s["bare vLLM generate"] / plain, s["nv.generate, all layers"] / plain
    assert (f"the engine's own generate took {own:.2f}x plain vLLM's and `nv.generate` keeping every block "
            f"{every:.2f}x") in flat, (own, every)
    assert f"`{run['command']}`" in flat, run["command"]


def test_the_interval_of_a_median_ratio_holds_the_median_as_often_as_it_says():
    """``median_interval`` (the tables' "95% interval"): of 12 values, the 3rd and the 10th; on draws
    from a skewed distribution with a known median it holds the median in at least 95% of samples
    (96.1% in theory), while the next narrower choice would not; too few values give no interval."""
    import random
    import sys

    sys.path.insert(0, str(README.parent / "benchmarks"))
    from capture_gpu import median_interval

    assert median_interval([float(x) for x in (9, 1, 12, 4, 7, 2, 11, 3, 10, 5, 8, 6)]) == (3.0, 10.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)
    rng, trials = random.Random(0), 4000
    median = 2 ** 0.5  # of 2 ** N(0.5, 1): log-normal, skewed
    held = narrower = 0
    for _ in range(trials):
        xs = [2 ** rng.gauss(0.5, 1.0) for _ in range(12)]
        lo, hi = median_interval(xs)
        held += lo < median < hi
        s = sorted(xs)
        narrower += s[3] < median < s[8]
    assert 0.95 <= held / trials <= 0.975, held / trials
    assert narrower / trials < 0.9, narrower / trials


def _fastest_steps(calls: dict, case: str) -> list[float]:
    """The fastest call of each step of the gap against the step before (settings over bare, own over
    settings, in_process over own, default over in_process), then default's over bare's, rounded."""
    fastest = {form: min(calls[f"{case}_{form}"]) for form in ("bare", "settings", "own", "in_process", "default")}
    steps = [("settings", "bare"), ("own", "settings"), ("in_process", "own"), ("default", "in_process"), ("default", "bare")]
    return [round(fastest[a] / fastest[b], 2) for a, b in steps]


def test_the_h100_paired_split_table_in_docs_capture_is_its_recorded_run():
    """docs/capture.md's H100 table and figures of run ``llama1b_paired_split``: the table as
    ``capture_gpu.py --table`` renders it, each step of the gap between fastest calls (the V1 runner
    among them), the summary at the top of "What it costs", each engine's runner and settings, the
    server's adds, the spreads, the per-step host time (with the steps the H100's profile counted),
    each engine's first measured call, and no hand-off file made after each engine's first call."""
    import json
    import statistics
    import subprocess
    import sys

    root = README.parent
    doc = (root / "docs" / "capture.md").read_text()
    flat = " ".join(doc.split())
    path = root / "benchmarks" / "results" / "capture_gpu_h100_80gb_hbm3.json"
    run = json.loads(path.read_text())["runs"]
    r = run["llama1b_paired_split"]
    s = r["seconds"]
    tool = subprocess.run([sys.executable, str(root / "benchmarks" / "capture_gpu.py"), "--table", "llama1b_paired_split",
                           "--out", str(path)], capture_output=True, text=True, check=True).stdout
    rendered = {row[0].strip("`"): row[1:] for row in _md_rows(tool, "x bare, per turn")}
    doc_rows = _md_rows(doc, "bare vLLM's calls spread by")
    forms = ["bare", "settings", "v1", "own", "default", "in_process"]
    assert [row[1:] for row in doc_rows] == [rendered[f] for f in forms], (doc_rows, rendered)
    assert f"bare vLLM's calls spread by {rendered['bare'][3]}:" in flat
    fastest = {f: min(r["all"][f"paired_split_{f}"]) for f in forms}
    st = [round(fastest[a] / fastest[b], 2) for a, b in (("settings", "bare"), ("v1", "settings"), ("own", "v1"),
                                                        ("in_process", "own"), ("default", "in_process"), ("default", "bare"))]
    assert (f"the settings {st[0]:.2f}x, the V1 runner {st[1]:.2f}x more, nnsight's runner with nnvllm's taps "
            f"{st[2]:.2f}x more, the capture {st[3]:.2f}x more, the isolation {st[4]:.2f}x more, {st[5]:.2f}x in all") in flat, st
    assert max(st[:5]) == st[3] and st[2] <= 1.01 and st[4] <= 1.01  # "nothing measurable" besides the V1 runner
    h200 = _fastest_steps(json.loads((root / "benchmarks" / "results" / "capture_gpu_h200.json").read_text())
                          ["runs"]["llama1b_paired_split"]["all"], "paired_split")
    assert (f"{h200[4]:.2f}x on the H200 and {st[5]:.2f}x on the H100, between each engine's fastest calls" in flat
            and f"The capture is the largest share of that ({h200[2]:.2f}x and {st[3]:.2f}x" in flat
            and max(h200[:4]) == h200[2] and f"by default, is {st[1]:.2f}x;" in flat), (h200, st)
    cfg = s["paired_split_config"]
    assert {f: cfg[f]["model_runner"] for f in ("bare", "settings", "v1", "in_process")} == {
        "bare": "V2", "settings": "V2", "v1": "V1", "in_process": "V1"}, cfg
    assert cfg["isolated"] == {"async_scheduling": True, "compile_mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert {cfg[f]["async_scheduling"] for f in ("in_process", "settings", "v1")} == {True}
    assert {cfg[f]["cudagraph_mode"] for f in ("in_process", "settings", "v1")} == {"FULL_DECODE_ONLY"}
    adds = statistics.median(c["client_server_add"] for c in r["per_call"]["paired_split_default"])
    assert f"adds the call's 64 requests in {adds:.3f} s (median)" in flat, adds
    gens = [statistics.median(c[k] for c in r["per_call"][f"paired_split_{f}"])
            for f, k in (("default", "client_server_generate"), ("in_process", "client_generate"))]
    assert f"generation took {gens[0]:.3f} s against the in-process engine's {gens[1]:.3f} s (medians)" in flat, gens
    summary = s["paired_split_summary"]
    assert (f"Every call of `nv.load(path)` was within {100 * summary['spread default']:.0f}% of its median, and of "
            f"`nv.load(path, isolate=False)` within {100 * summary['spread in_process']:.0f}%") in flat
    host = statistics.median(c["step_host"] for c in r["per_call"]["paired_split_in_process"])
    steps = [ln for ln in run["llama1b_split_profile"]["profiles"]["nv_split_profile_all"]["ours"]
             if ln.endswith("arena.py:210(step)")]
    assert steps and steps[0].split()[0] == "128", steps
    assert f"had a median of {1e3 * host:.1f} ms a call in-process, about {round(1e6 * host / 128, -1):.0f} µs" in flat
    for calls in r["per_call"].values():
        assert [c["files_made"] for c in calls[1:]] == [0] * (len(calls) - 1)
    firsts = []
    for form in ("default", "in_process"):
        times = r["all"][f"paired_split_{form}"]
        assert times[0] < max(times)
        firsts.append(f"{times[0]:.3f} s")
    assert f"each engine's first measured call ({firsts[0]} and {firsts[1]}) was not its slowest" in flat
    assert "gpu/model_states" in " ".join(run["llama1b_host"]["profiles"]["bare_profile"]["syncs"])  # V2
    assert "gpu_model_runner.py" in " ".join(run["llama1b_host"]["profiles"]["nv_split_profile_all"]["syncs"])


def test_the_trace_cost_tables_in_docs_engines_are_their_recorded_runs():
    """docs/engines.md's tables of what a trace sends and sends back state the seconds of the CPU runs
    in ``benchmarks/results/trace_payload_cpu.json`` and ``trace_saves_cpu.json``, and the text the
    differences between them."""
    import json

    root = README.parent
    doc = (root / "docs" / "engines.md").read_text()
    flat = " ".join(doc.split())
    payload = json.loads((root / "benchmarks" / "results" / "trace_payload_cpu.json").read_text())["runs"]
    rows = _md_rows(doc, "`benchmarks/results/trace_payload_cpu.json`")
    which = {"nnsight's": "nnsight", "names left behind, envoys pickled": "names", "nnvllm's (both)": "nnvllm"}
    assert len(rows) == 6, rows
    for row in rows:
        run = payload["64x1" if row[0].startswith("1") else "64x32"]["seconds"]
        case = which[row[1]]
        assert [row[2], row[3]] == [f"{run[f'{case} fresh']:.3f} s", f"{run[f'{case} again']:.3f} s"], row
    saves = json.loads((root / "benchmarks" / "results" / "trace_saves_cpu.json").read_text())["runs"]["64x32"]
    s = saves["seconds"]
    assert saves["repeats"] == 5 and "--repeats 5" in saves["command"]
    rows = _md_rows(doc, "`benchmarks/results/trace_saves_cpu.json`")
    assert [r[0] for r in rows] == ["the blocks stacked, one tensor a step",
                                    "each block's output, one tensor a block a step", "nothing (the same reads)"]
    for row, kind in zip(rows, ("stacked", "per_block", "nothing")):
        assert row[1] == f"{saves['saved_tensors'][kind]:,}", row
        assert row[2:4] == [f"{s[f'{kind} nnsight']:.3f} s", f"{s[f'{kind} nnvllm']:.3f} s"], row
        hop = [f"{s[f'{kind} hop {h}']:.3f} s" for h in ("torch_save", "packed")] if kind != "nothing" else ["", ""]
        assert row[4:6] == hop, row
    floor = min(s["nothing nnsight"], s["nothing nnvllm"])
    above = [f"{s[f'{k} {w}'] - floor:.3f} s" for k in ("stacked", "per_block") for w in ("nnsight", "nnvllm")]
    assert (f"costs {above[0]} against {above[1]} (stacked) and {above[2]} against {above[3]} (each block)"
            in flat), above
    assert f"`nv.generate` keeping the same blocks took {s['nv.generate']:.3f} s" in flat

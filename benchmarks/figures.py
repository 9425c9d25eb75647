#!/usr/bin/env python3
"""The figures in the README and docs/, written from the output files in docs/figures/.

    python benchmarks/figures.py                    # check: exit 1 where a page disagrees with its files
    python benchmarks/figures.py write              # rewrite every figure block from the files
    python benchmarks/bench.py && python benchmarks/bench.py --ranks && \\
        python benchmarks/figures.py write --bench-out bench-out   # take a new benchmark's files first
    python benchmarks/figures.py sample             # the bundled sample, seeds 0-2 (under a minute)
    python benchmarks/figures.py sweep              # the README's sweep, its summary and the screenshots
    python benchmarks/figures.py mlflow             # a run stopped and continued, in a real MLflow's UI
    python benchmarks/figures.py tests P-not-slurm.xml P-slurm-1.xml P-slurm-2.xml P-slurm-3.xml --fast P-fast.xml
                                  # the suite's size and time: make test JUNIT=P, make test-fast JUNIT=P

A figure block in a page sits between `<!-- figures: NAME -->` and `<!-- /figures -->`;
BLOCKS below says what writes each one, and every block of measured figures names the
machine and the date its file came from. mnist_ddp.py's manual (its docstring, which
--help prints) has no markers: its "What it reaches" section is written whole, by
manual_figures(). The output files (docs/figures/):
  bench.json, ranks.json   benchmarks/bench.py and bench.py --ranks (copied from bench-out/)
  step-times.json          benchmarks/bench.py --step-times (copied from bench-out/ likewise)
  compile-cache.json       benchmarks/bench.py --compile-cache (copied from bench-out/ likewise)
  sample.json              `sample`: mnist_ddp.py's defaults on the bundled sample, seeds 0-2
  sweep.json, sweep-summary.txt, tensorboard-sh.txt, and docs/tensorboard-*.png
                           `sweep`: the README's sweep with `sweep.py run`, its summary, and
                           the real tensorboard.sh on it, photographed by headless Chromium
  tests.json               `tests`: a run of the suite and one of its fast tier, their JUnit files
  docs/mlflow-*.png        `mlflow`: a run with --tracker mlflow stopped on 2 ranks and continued on
                           1, in a real MLflow server's UI, photographed by headless Chromium
"""

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path

from bench import machine, markdown, ranks_tables  # (this script's own directory comes first on sys.path)

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MANUAL = ROOT / "mnist_ddp.py"
# The manual's section of measured figures: its heading line up to the blank line after it.
MANUAL_FIGURES = re.compile(r"^What it reaches\b.*?(?=\n\n)", re.S | re.M)
BLOCK = re.compile(r"<!-- figures: (\S+) -->((?:(?!<!-- figures:).)*?)<!-- /figures -->", re.S)  # (none inside another)
EXAMPLE_USER, EXAMPLE_HOST = "alice", "login1.cluster.example"  # the README's, for this machine's


def load(name: str) -> dict:
    path = FIGURES / name
    if not path.exists():
        raise SystemExit(f"figures.py: {path.relative_to(ROOT)} is missing; see `python benchmarks/figures.py --help` for "
                         "the command that writes it")
    return json.loads(path.read_text())


def machine_words(m: dict) -> str:
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_gb']} GiB, {'no GPU' if m.get('gpu', 'none') == 'none' else m['gpu']}"


def source(m: dict) -> str:
    """Where a figure came from: the machine and the date."""
    return f"{machine_words(m)}; {m['date']}"


def data_words(dataset: str) -> str:
    return {"fashion-mnist": "full Fashion-MNIST", "mnist-sample": "the bundled MNIST sample"}.get(dataset, dataset)


# ----------------------------------------------------------------------------- the blocks

def benchmark_summary() -> str:
    """README, Benchmark: the headline figures of bench.json."""
    b = load("bench.json")
    ref, ours, target = b["reference"], b["default"], f"{100 * b['target_accuracy']:.0f} %"
    second = next((e for e in ref["epochs"] if e["epoch"] == 2), None)
    against_second = (f"; {b['time_ratio_reference_epoch_2']:.1f}x against its second epoch, at "
                      f"{100 * second['test_accuracy']:.2f} %") if second and b.get("time_ratio_reference_epoch_2") else ""
    ordinal = {1: "first", 2: "second", 3: "third", 4: "fourth"}.get(ref["crossed_at_epoch"], f"epoch {ref['crossed_at_epoch']}")
    reference = (f"the reference loop of the usual examples {ref['time_to_target_s']:.1f} s, in its {ordinal} epoch "
                 f"({b['time_ratio']:.1f}x shorter{against_second})") if ref["time_to_target_s"] else \
        f"the reference loop of the usual examples not in its {len(ref['epochs'])} epochs"
    ours_ordinal = {1: "first", 2: "second", 3: "third"}.get(ours["crossed_at_epoch"], f"{ours['crossed_at_epoch']}th")
    return (f"Latest run ({b['machine']['date']}), on {data_words(b['dataset'])}, on {machine_words(b['machine'])}: "
            f"the defaults reach {target} test accuracy {ours['time_to_target_s']:.1f} s from process start, in their "
            f"{ours_ordinal} epoch, and end at {100 * ours['final_accuracy']:.2f} % after {len(ours['epochs'])}; {reference}; "
            f"training images/s {ours['images_per_s']:.0f} against {ref['images_per_s']:.0f} ({b['speed_ratio']:.1f}x).")


def benchmark_table() -> str:
    """docs/benchmark.md: the whole table of bench.json, as bench.py writes it."""
    b = load("bench.json")
    table = markdown(b).replace(f"Data: {b['dataset']}.", f"Data: {data_words(b['dataset'])}.", 1)
    return f"\nLatest run (`python benchmarks/bench.py`, {b['machine']['date']}). {table}"


def ranks_table() -> str:
    """docs/what-it-does.md, The same model from 1 or 16 ranks: test accuracy by rank count, from ranks.json."""
    r = load("ranks.json")
    data = data_words(r["dataset"])
    lines = [f"{data[0].upper()}{data[1:]}, `torchrun`, one thread per rank from 2 ranks on ({source(r['machine'])}), "
             "from `python benchmarks/bench.py --ranks`: the defaults to the end, then 2 epochs three ways:", "",
             *ranks_tables(r)]
    return "\n".join(lines) + "\n"


def lr_rule_gain() -> str:
    """docs/defaults.md, batch: the share of what --batch-size 128 loses against 1 rank that
    --lr x sqrt(ranks) wins back, by rank count, from ranks.json (bench.py --ranks writes its
    three ways in this order)."""
    r = load("ranks.json")
    _, weak, rule = r["accuracy"].values()
    counts = [n for n in weak if int(n) > 1 and weak[n] < weak["1"]]
    shares = [f"{100 * (rule[n] - weak[n]) / (weak['1'] - weak[n]):.0f} %" for n in counts]

    def listed(words: list[str]) -> str:
        return " and ".join(filter(None, [", ".join(words[:-1]), words[-1]]))
    return f"{listed(shares)} of what {listed(counts)} ranks lose in 2 epochs ({source(r['machine'])})"


def ranks_speed() -> str:
    """docs/what-it-does.md: 2 ranks of one thread against 1 rank of 2 threads at the
    default global batch, from bench.json's scaling run."""
    b = load("bench.json")
    s = b["scaling"]
    return (f"{s['2x1_images_per_s']:,.0f} training images/s from 2 ranks of one thread (64 images a rank) against "
            f"{s['1x2_images_per_s']:,.0f} from 1 rank of 2 threads, {s['ratio']:.2f}x, with "
            f"{100 * s['2x1_accuracy']:.2f} % against {100 * s['1x2_accuracy']:.2f} % after 2 epochs "
            f"({data_words(b['dataset'])}, `python benchmarks/bench.py`, {source(b['machine'])})")


def startup_line() -> str:
    """docs/what-it-does.md, Start-up: the `ready in` line of the benchmark's run of the defaults."""
    b = load("bench.json")
    return (f"`{b['default']['ready_line']}` (the benchmark's run of the defaults, one process, "
            f"{data_words(b['dataset'])}; {source(b['machine'])})")


def speed_ratio() -> str:
    """docs/defaults.md: the benchmark's training images/s, the defaults over the reference loop."""
    b = load("bench.json")
    return f"{b['speed_ratio']:.1f}x ({source(b['machine'])})"


def defaults_accuracy() -> str:
    """docs/defaults.md, round 3: the test accuracy of the benchmark's run of the defaults."""
    b = load("bench.json")
    by_epoch = {e["epoch"]: 100 * e["test_accuracy"] for e in b["default"]["epochs"]}
    return (f"{by_epoch[1]:.2f} % after the first epoch and {by_epoch[max(by_epoch)]:.2f} % after the last "
            f"({source(b['machine'])})")


def sample_runs() -> tuple[dict, list[float], float]:
    """sample.json, its runs' test accuracies (%), and the median run's wall time."""
    s = load("sample.json")
    return s, [100 * run["test_accuracy"] for run in s["runs"]], statistics.median(run["wall_s"] for run in s["runs"])


def sample_accuracy() -> str:
    """The defaults on the bundled sample: accuracy over seeds, and the time of a run."""
    s, accuracies, wall = sample_runs()
    seeds = [run["seed"] for run in s["runs"]]
    return (f"{min(accuracies):.1f}-{max(accuracies):.1f} % (seeds {seeds[0]}-{seeds[-1]}, {s['epochs']} epochs, "
            f"{wall:.0f} s a run; {source(s['machine'])})")


def make_run_line() -> str:
    """README, Try it: what `make run` gives."""
    s, accuracies, wall = sample_runs()
    return ("\n```sh\n"
            "make run     # creates .venv if missing, trains one process on the bundled MNIST sample\n"
            f"             # (~{min(accuracies):.0f} %, ~{wall:.0f} s once .venv exists; {source(s['machine'])})\n"
            "make test    # as root: installs what the tests need into .venv, runs ruff and the whole test suite\n"
            "```\n")


def sweep_summary() -> str:
    """docs/sweeps.md: `sweep.py summary` of the README's sweep."""
    s = load("sweep.json")
    return ("\n```\n$ python sweep.py summary runs/lr-bs\n" + (FIGURES / "sweep-summary.txt").read_text() + "```\n\n"
            f"(The README's sweep, run with `python sweep.py run` on the bundled sample: "
            f"`python benchmarks/figures.py sweep`; {source(s['machine'])}.)\n")


def sweep_source() -> str:
    return source(load("sweep.json")["machine"])


def hparams_columns() -> str:
    s = load("sweep.json")
    return f"{s['hparams_declared']} options"


def tensorboard_output() -> str:
    """README, Watching training: what tensorboard.sh prints before TensorBoard starts."""
    text = (FIGURES / "tensorboard-sh.txt").read_text()
    return f"\n```\n{text}```\n"


def test_times() -> str:
    """README, Tests: the suite's size and time, and its fast tier's."""
    t = load("tests.json")
    return (f"`make test` runs everything on CPU with no network ({t['tests']} tests in {t['seconds'] / 60:.0f} minutes; "
            f"{source(t['machine'])}); `make test-fast` runs the fast tier on every core, without the tests that start a "
            f"local Slurm, network namespaces or sshd (`tests/cluster/`) and the longer end-to-end runs (marked `slow` "
            f"where they stand): {t['fast_tests']} tests in {t['fast_seconds'] / 60:.1f} minutes, no root needed.")


def step_times() -> str:
    """docs/recovery.md, Which rank is slow: what the straggler figures cost a step, and the
    spread of the runs, which says whether the difference is more than noise."""
    t = load("step-times.json")
    ms, runs = t["ms_per_step"], len(t["images_per_s"]["with"])
    spread = {way: sorted(128_000 / v for v in speeds) for way, speeds in t["images_per_s"].items()}
    overlap = spread["with"][0] <= spread["without"][-1] and spread["without"][0] <= spread["with"][-1]
    verdict = "no cost measurable above the runs' own spread" if overlap else "a cost above the runs' own spread"
    return (f"{verdict}: {t['cost_ms_per_step']:+.3f} ms a step ({100 * (t['cost_ratio'] - 1):+.1f} %; {ms['with']:.2f} ms "
            f"with them, {ms['without']:.2f} ms without, the medians of {runs} runs of 1 epoch each way, alternately, "
            f"the runs themselves spread over {spread['with'][0]:.1f}-{spread['with'][-1]:.1f} ms and "
            f"{spread['without'][0]:.1f}-{spread['without'][-1]:.1f} ms a step), on 2 ranks of one thread, "
            f"{data_words(t['dataset'])} (`python benchmarks/bench.py --step-times`, {source(t['machine'])})")


def compile_cache() -> str:
    """docs/defaults.md, the options for GPUs: a later --compile start with the run's compile
    cache on an empty local cache, against the first start."""
    c = load("compile-cache.json")
    runs = len(c["pairs"])
    return (f"a later start on an empty local cache reached its first step in {c['later_s']:.1f} s, the first start in "
            f"{c['first_s']:.1f} s, from process start (the medians of {runs} runs of both; ratio {c['ratio']:.2f}, the "
            f"median of the runs' own, {min(c['ratios']):.2f}-{max(c['ratios']):.2f}; one process, "
            f"{data_words(c['dataset'])}; `python benchmarks/bench.py --compile-cache`, {source(c['machine'])})")


def manual_figures() -> str:
    """mnist_ddp.py's docstring (its --help), "What it reaches": each figure with its machine and date."""
    s, accuracies, wall = sample_runs()
    b, r = load("bench.json"), load("ranks.json")
    ours, ref = b["default"], b["reference"]
    by_epoch = {e["epoch"]: 100 * e["test_accuracy"] for e in ours["epochs"]}
    last = max(by_epoch)
    defaults = r["defaults"]
    counts = [int(n) for n in defaults]
    first, final = [100 * run["epoch_1"] for run in defaults.values()], [100 * run["last"] for run in defaults.values()]
    sources = [source(s["machine"]), source(b["machine"]), source(r["machine"])]
    shared = len(set(sources)) == 1  # then named once, under the heading
    at = ["" if shared else f" ({where})" for where in sources]
    bullets = [
        f"the bundled 4,000-image MNIST sample, defaults ({s['epochs']} epochs, 1 process): "
        f"{min(accuracies):.1f}-{max(accuracies):.1f} % test accuracy (seeds {s['runs'][0]['seed']}-{s['runs'][-1]['seed']}), "
        f"~{wall:.0f} s a run{at[0]};",
        f"{data_words(b['dataset'])}, defaults: {by_epoch[1]:.1f} % after the first epoch, {by_epoch[last]:.1f} % after "
        f"the last, epoch {last} (evaluated with the --ema average of the weights); it reaches {100 * b['target_accuracy']:.0f} % "
        f"{b['time_ratio']:.1f}x sooner than the usual DataLoader + ToTensor example loop, from process start "
        f"({ours['time_to_target_s']:.1f} s against {ref['time_to_target_s']:.1f} s){at[1]};",
        f"{data_words(r['dataset'])}, defaults, from {', '.join(map(str, counts[:-1]))} or {counts[-1]} ranks, the global "
        f"batch split among them: {min(first):.2f}-{max(first):.2f} % after the first epoch, "
        f"{min(final):.2f}-{max(final):.2f} % after the last{at[2]}.",
    ]
    heading = ["What it reaches", textwrap.fill(f"measured{' on ' + sources[0] if shared else ''}; the method and every "
                                                "figure: docs/benchmark.md", 88, initial_indent="  ", subsequent_indent="  ")]
    return "\n".join(heading + [textwrap.fill(b, 88, initial_indent="  * ", subsequent_indent="    ") for b in bullets])


BLOCKS = {"benchmark-summary": benchmark_summary, "benchmark-table": benchmark_table, "ranks-table": ranks_table,
          "ranks-speed": ranks_speed, "lr-rule-gain": lr_rule_gain,
          "startup-line": startup_line, "sample-accuracy": sample_accuracy, "make-run": make_run_line,
          "sweep-summary": sweep_summary, "sweep-source": sweep_source, "hparams-columns": hparams_columns,
          "tensorboard-output": tensorboard_output, "test-times": test_times, "speed-ratio": speed_ratio,
          "defaults-accuracy": defaults_accuracy, "step-times": step_times, "compile-cache": compile_cache}


def rewritten(text: str, page: Path) -> str:
    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name not in BLOCKS:
            raise SystemExit(f"figures.py: {page.relative_to(ROOT)}: no figure block is called {name!r}; "
                             f"the blocks: {', '.join(BLOCKS)}")
        figure = BLOCKS[name]()
        if match.start() == 0 or text[match.start() - 1] == "\n":  # a block of its own (Markdown reads the
            figure = "\n" + figure.strip("\n") + "\n"            # marker's line as HTML)
        return f"<!-- figures: {name} -->{figure}<!-- /figures -->"
    if text.count("<!-- figures:") != len(BLOCK.findall(text)):
        raise SystemExit(f"figures.py: {page.relative_to(ROOT)}: a `<!-- figures: NAME -->` has no `<!-- /figures -->` "
                         "before the next block; close it")
    return BLOCK.sub(fill, text)


def rewritten_manual() -> tuple[str, str]:
    """mnist_ddp.py's text, and the same with its "What it reaches" section written from the files."""
    text = MANUAL.read_text()
    if len(MANUAL_FIGURES.findall(text)) != 1:
        raise SystemExit(f"figures.py: {MANUAL.relative_to(ROOT)}: its docstring needs one section that starts with a "
                         "line 'What it reaches' and ends at a blank line; put it back")
    return text, MANUAL_FIGURES.sub(lambda _: manual_figures(), text)


def check() -> int:
    stale = []
    text, new = rewritten_manual()
    if new != text:
        stale.append(f"{MANUAL.relative_to(ROOT)}: What it reaches")
    for page in PAGES:
        text = page.read_text()
        new = rewritten(text, page)
        if new != text:
            names = [m.group(1) for m, n in zip(BLOCK.finditer(text), BLOCK.finditer(new), strict=True) if m.group(0) != n.group(0)]
            stale.append(f"{page.relative_to(ROOT)}: {', '.join(names)}")
    for line in stale:
        print(f"figures.py: {line} differ from docs/figures/; run: python benchmarks/figures.py write")
    return 1 if stale else 0


def write(bench_out: Path | None) -> int:
    if bench_out:
        taken = [name for name in ("bench.json", "ranks.json", "step-times.json", "compile-cache.json")
                 if (bench_out / name).exists()]
        if not taken:
            raise SystemExit(f"figures.py: {bench_out} holds none of bench.json, ranks.json, step-times.json and "
                             "compile-cache.json; run benchmarks/bench.py first")
        for name in taken:  # refused before anything is copied
            run = json.loads((bench_out / name).read_text())
            if run.get("quick") or (name == "bench.json" and not {"reference", "default"} <= run.keys()):
                raise SystemExit(f"figures.py: {bench_out / name} is from bench.py --quick or --gpu, not the figures of "
                                 "the README; run benchmarks/bench.py (and --ranks) without them")
        for name in taken:
            shutil.copy(bench_out / name, FIGURES / name)
            print(f"took {bench_out / name}")
    text, new = rewritten_manual()
    if new != text:
        MANUAL.write_text(new)
        print(f"wrote {MANUAL.relative_to(ROOT)}")
    for page in PAGES:
        text = page.read_text()
        new = rewritten(text, page)
        if new != text:
            page.write_text(new)
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


# ----------------------------------------------------------------------------- the measurements

def measure_sample(seeds: list[int]) -> int:
    """mnist_ddp.py's defaults on the bundled sample, one process each, one seed after another."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            run_dir = Path(tmp) / f"seed{seed}"
            started = time.perf_counter()
            subprocess.run([sys.executable, str(ROOT / "mnist_ddp.py"), "--seed", str(seed), "--run-dir", str(run_dir)],
                           check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - started
            last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
            runs.append({"seed": seed, "test_accuracy": last["test_accuracy"], "wall_s": round(wall, 1)})
            print(f"seed {seed}: {100 * last['test_accuracy']:.2f} % in {wall:.1f} s", flush=True)
    (FIGURES / "sample.json").write_text(json.dumps({"machine": machine(), "epochs": last["epoch"], "runs": runs}, indent=2) + "\n")
    return 0


def tier_tests(files: list[str], marker: str) -> set[tuple[str, str]]:
    """The tests of these files that `pytest -m MARKER` runs, as JUnit's (classname, name):
    the tests' own marking decides (their folders' conftest.py, `slow` where it stands), not a
    copy of its rule."""
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "-m", marker, *files], cwd=ROOT, capture_output=True, text=True)
    if collected.returncode not in (0, 5):  # 5: every test deselected
        raise SystemExit(f"figures.py: pytest could not collect {' '.join(files)}:\n{collected.stdout}{collected.stderr}")
    ids = set()
    for node in (line for line in collected.stdout.splitlines() if "::" in line):
        # (a parameter's id may hold "::" itself, as an IPv6 address does: split before the "[")
        test, bracket, params = node.partition("[")
        path, *classes, name = test.split("::")
        name += bracket + params
        ids.add((".".join([path.removesuffix(".py").replace("/", "."), *classes]), name))
    return ids


def read_junit(junit: Path) -> tuple[list, float, float]:
    """(the test cases, the run's start as a POSIX time, its length in seconds) of one pytest
    --junitxml file, which passed."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = suite.findall("testcase")
    bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    if bad:
        raise SystemExit(f"figures.py: {len(bad)} tests failed in {junit}; the figures come from a run that passed")
    return cases, datetime.datetime.fromisoformat(suite.get("timestamp")).timestamp(), float(suite.get("time"))


def wall_seconds(spans: list[tuple[float, float]]) -> float:
    """The time covered by (start, end) spans: runs one after the other add up, runs at the
    same time (make test's Slurm groups) count once, as the longest of them."""
    covered, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        covered += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return covered


def case_file(case) -> str:
    return "/".join(part for part in case.get("classname", "").split(".") if not part[:1].isupper()) + ".py"  # (a class name is capitalised)


def summarise_tests(junits: list[Path], fast: Path) -> int:
    """The suite's size and time from the JUnit XML files of one `make test` (its parts: the
    tests without Slurm, then the Slurm groups at the same time; the time is what their
    sessions cover, from each file's start and length), and the fast tier's from one `make
    test-fast`: a file that holds a test outside the tier, or misses one, is refused."""
    runs = [read_junit(junit) for junit in junits]
    fast_cases, _, fast_seconds = read_junit(fast)
    files = sorted({case_file(c) for cases, _, _ in runs for c in cases})
    tier = tier_tests(files, "not slurm and not slow")
    ran = {(c.get("classname"), c.get("name")) for c in fast_cases}
    if ran != tier:
        raise SystemExit(f"figures.py: {fast} is not a run of the fast tier (make test-fast): {len(ran - tier)} tests outside "
                         f"it, {len(tier - ran)} of it missing")
    (FIGURES / "tests.json").write_text(json.dumps({
        "machine": machine(), "tests": sum(len(cases) for cases, _, _ in runs),
        "seconds": round(wall_seconds([(start, start + length) for _, start, length in runs]), 1),
        "fast_tests": len(fast_cases), "fast_seconds": round(fast_seconds, 1)}, indent=2) + "\n")
    print(f"wrote {(FIGURES / 'tests.json').relative_to(ROOT)}")
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise SystemExit(f"figures.py: TensorBoard did not listen on port {port} within {timeout:.0f} s")


def screenshot(url: str, path: Path, size: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not chromium:
        raise SystemExit("figures.py: no chromium on the PATH; install it (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={size}", "--virtual-time-budget=30000",
                        f"--screenshot={path}", url], check=True, capture_output=True, timeout=120)
    print(f"wrote {path.relative_to(ROOT)}")


def photograph_sweep() -> int:
    """The README's sweep on the bundled sample with `sweep.py run`, its summary, and the
    real tensorboard.sh on it, photographed by headless Chromium."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "LOG_DIR": str(work / "runs")}
        (work / "sweeps").mkdir()
        grid = subprocess.run([sys.executable, str(ROOT / "sweep.py"), "grid", "--lr", "3e-3", "1e-3", "--batch-size",
                               "64", "128", "--epochs", "4"], check=True, capture_output=True, text=True).stdout
        (work / "sweeps" / "lr-bs.txt").write_text(grid)
        subprocess.run([sys.executable, str(ROOT / "sweep.py"), "run", "sweeps/lr-bs.txt"], cwd=work, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        summary = subprocess.run([sys.executable, str(ROOT / "sweep.py"), "summary", "runs/lr-bs"], cwd=work, env=env,
                                 check=True, capture_output=True, text=True).stdout
        (FIGURES / "sweep-summary.txt").write_text(summary)
        declared = EventAccumulator(str(next((work / "runs" / "lr-bs").glob("*.hparams"))))
        declared.Reload()
        experiment = metadata.parse_experiment_plugin_data(
            declared.SummaryMetadata(metadata.EXPERIMENT_TAG).plugin_data.content)
        (FIGURES / "sweep.json").write_text(json.dumps({"machine": machine(), "hparams_declared": len(experiment.hparam_infos)},
                                                       indent=2) + "\n")

        port = free_port()
        board = subprocess.Popen([str(ROOT / "tensorboard.sh"), "--logdir", "runs/lr-bs", "--port", str(port)], cwd=work,
                                 env={**env, "LOGIN_HOST": ""}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        try:
            printed = []
            for line in board.stdout:
                printed.append(line)
                if line.startswith("TensorBoard on "):
                    break
            wait_for_http(port, 60)
            time.sleep(3)  # its first reload of the runs
            user, node = os.environ.get("USER") or subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip(), \
                subprocess.run(["hostname", "-f"], capture_output=True, text=True).stdout.strip()
            shown = "".join(printed).replace(str(port), "6006").replace(f"@{node}", f"@{EXAMPLE_HOST}").replace(
                f"{user}@", f"{EXAMPLE_USER}@").replace(str(work) + "/", "")
            (FIGURES / "tensorboard-sh.txt").write_text(shown)
            for tab, view, size in (("scalars", "scalars&_smoothingWeight=0&tagFilter=(test%7Ctrain)%2F(accuracy%7Closs)", "1400,760"),
                                    ("images", "images&tagFilter=confusion%7Cpredictions", "1400,1100"),
                                    ("hparams", "hparams", "1900,600")):
                screenshot(f"http://127.0.0.1:{port}/#{view}", ROOT / "docs" / f"tensorboard-{tab}.png", size)
        finally:
            os.killpg(board.pid, signal.SIGTERM)
            board.wait(30)
    return 0


def photograph_mlflow() -> int:
    """A run with --tracker mlflow, stopped on 2 ranks at step 60 and continued on 1 rank to its
    end, as a real MLflow server (its own SQLite store, on loopback) shows it: the run's page and
    its metrics, photographed by headless Chromium (needs `pip install mlflow`)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                                   "--workers", "1", "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
                                   "--default-artifact-root", str(work / "artifacts")], cwd=work,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for_http(port, 120)
            env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "OMP_NUM_THREADS": "1"}
            args = [str(ROOT / "mnist_ddp.py"), "--epochs", "4", "--run-name", "stopped-and-continued", "--tracker", "mlflow"]
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args,
                            "--interrupt-at", "60:USR1"], cwd=work, env=env, capture_output=True)
            subprocess.run([sys.executable, *args], cwd=work, env=env, check=True, capture_output=True)
            (state,) = json.loads((work / "runs" / "stopped-and-continued" / "tracker.json").read_text()).values()
            page = f"http://127.0.0.1:{port}/#/experiments/0/runs/{state['run_id']}"
            screenshot(page, ROOT / "docs" / "mlflow-run.png", "1500,1900")
            keys = ["test/accuracy", "train/loss", "test/loss"]
            query = {"runs": json.dumps([state["run_id"]]), "metric": json.dumps(keys[0]), "experiments": json.dumps(["0"]),
                     "plot_metric_keys": json.dumps(keys), "plot_layout": "{}", "x_axis": "step", "y_axis_scale": "linear",
                     "line_smoothness": "1", "show_point": "true", "deselected_curves": "[]", "last_linear_y_axis_range": "[]"}
            chart = (f"http://127.0.0.1:{port}/#/metric/{urllib.parse.quote(keys[0], safe='')}?"
                     + urllib.parse.urlencode(query, quote_via=urllib.parse.quote))
            screenshot(chart, ROOT / "docs" / "mlflow-metrics.png", "1500,900")
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False)
    parser.add_argument("command", nargs="?", default="check", choices=("check", "write", "sample", "sweep", "mlflow", "tests"))
    parser.add_argument("junit", nargs="*", type=Path, help="tests: the --junitxml files of one `make test` (make test JUNIT=PREFIX)")
    parser.add_argument("--fast", type=Path, help="tests: the --junitxml file of one `make test-fast`")
    parser.add_argument("--bench-out", type=Path, help="write: take bench.json and ranks.json from this directory first")
    args = parser.parse_args()
    if args.command == "check":
        return check()
    if args.command == "write":
        return write(args.bench_out)
    if args.command == "sample":
        return measure_sample([0, 1, 2])
    if args.command == "sweep":
        return photograph_sweep()
    if args.command == "mlflow":
        return photograph_mlflow()
    if not args.junit or not args.fast:
        parser.error("tests needs the JUnit XML files of make test and make test-fast: make test JUNIT=/tmp/suite && "
                     "make test-fast JUNIT=/tmp/suite, then: tests /tmp/suite-not-slurm.xml /tmp/suite-slurm-1.xml "
                     "/tmp/suite-slurm-2.xml /tmp/suite-slurm-3.xml --fast /tmp/suite-fast.xml")
    return summarise_tests(args.junit, args.fast)


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark's one command runs end to end (its --quick mode: a few steps of every
part) and writes its JSON and Markdown table with every figure present; so does its table
by rank count (--ranks --quick, on 1 and 2 ranks), its cost of the straggler figures
(--step-times --quick), world_sizes.py's closeness of runs that go on on another number
of ranks (one epoch), and recipe_search.py's held-out score and step timings. It asserts no
timings: those are measured by the full run and written in the README.

    python -m pytest tests/runs/test_benchmark.py
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.processes import ROOT, clean_env, run_python


@pytest.mark.slow
def test_benchmark_quick_run(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--quick", "--out", str(tmp_path / "out")],
                            env=clean_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["dataset"] in ("fashion-mnist", "mnist-sample") and report["quick"]
    for part in ("reference", "default"):
        assert report[part]["images_per_s"] > 0 and report[part]["peak_rss_mb"] > 0
    assert report["default"]["overhead"] > 0 and report["default"]["overhead_per_epoch"] and report["scaling"]["ratio"] > 0
    for part in ("reference", "default"):  # counted from process start; the epoch each side crossed, if it did
        assert "crossed_at_epoch" in report[part] and all(e["since_start_s"] > 0 for e in report[part]["epochs"])
    table = (tmp_path / "out" / "bench.md").read_text()
    assert "| time to " in table and "from process start |" in table
    assert "| scaling: 2 ranks x 1 thread / 1 rank x 2 threads, the default global batch of 128 (2 x 64 / 1 x 128) |" in table
    assert "| weak scaling: the same with 128 images per rank (--batch-size 128: 2 x 128 / 1 x 128) |" in table


@pytest.mark.slow
def test_step_times_quick_run(tmp_path):
    """--step-times --quick: one run of 2 ranks with the straggler figures and one without
    (its ranks' timers given no model to watch), and the report of what they cost."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--step-times", "--quick", "--out",
                             str(tmp_path / "out")], env=clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "step-times.json").read_text())
    assert report["quick"] and {way: len(speeds) for way, speeds in report["images_per_s"].items()} == {"with": 1,
                                                                                                       "without": 1}
    assert all(ms > 0 for ms in report["ms_per_step"].values()) and report["cost_ratio"] > 0
    assert "| straggler figures | images/s (median) | ms a step |" in (tmp_path / "out" / "step-times.md").read_text()


def test_gpu_mode_says_when_there_is_no_gpu(tmp_path):
    """--gpu on a machine without one: one line and a non-zero exit, before any run."""
    result = run_python(["--gpu", "--quick", "--out", str(tmp_path / "out")], tmp_path,
                        script=ROOT / "benchmarks" / "bench.py", timeout=300, CUDA_VISIBLE_DEVICES="")
    assert result.returncode != 0 and "bench.py: --gpu needs a CUDA GPU, and torch sees none" in result.stderr


@pytest.mark.slow
def test_ranks_quick_run(tmp_path):
    """--ranks --quick: the tables by rank count, on 1 and 2 ranks: the defaults after the first and
    the last epoch, and each way after 2 epochs."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--ranks", "--quick", "--out",
                             str(tmp_path / "out")], env=clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "ranks.json").read_text())
    assert set(report["accuracy"]) == {"default (global batch 128)", "--batch-size 128 (global batch 128 x ranks)",
                                       "--batch-size 128 and --lr x sqrt(ranks)"}
    for by_ranks in report["accuracy"].values():
        assert set(by_ranks) == {"1", "2"} and all(0 < accuracy <= 1 for accuracy in by_ranks.values())
    assert set(report["defaults"]) == {"1", "2"}
    assert all(0 < run["epoch_1"] <= 1 and 0 < run["last"] <= 1 for run in report["defaults"].values())
    table = (tmp_path / "out" / "ranks.md").read_text()
    assert "| the defaults, test accuracy | 1 rank | 2 ranks |" in table and "| after epoch 1 |" in table
    assert "| test accuracy after 2 epochs | 1 rank | 2 ranks |" in table


@pytest.mark.slow
def test_world_sizes_compares_each_continued_run_with_the_run_that_kept_its_ranks(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "world_sizes.py"), "--epochs", "1", "--stop-at", "9",
                             "--out", str(tmp_path / "out")], env=clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for before, after in ((1, 2), (4, 2), (2, 1)):
        assert re.search(rf"^  {before} then {after} ranks: \S+ at step 12, \S+ at step 32; test accuracy \[\S+\] against ",
                         result.stdout, re.M), result.stdout
    assert "for scale, runs started on 1 and on 2 ranks at step 8: " in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="needs Debian's dataset-fashion-mnist")
def test_the_recipe_search_scores_a_variant_on_the_held_out_images_and_times_the_first_layers(tmp_path):
    """benchmarks/recipe_search.py, which chose the defaults (docs/defaults.md): one epoch of the
    defaults on 5,000 of the training images, scored on the held-out ones, its line and its
    JSON record; --speed's four models, one round of 2 steps."""
    script = ROOT / "benchmarks" / "recipe_search.py"
    result = subprocess.run([sys.executable, str(script), "--epochs", "1", "--train-images", "5000", "--data-dir",
                             str(tmp_path / "data"), "--json", str(tmp_path / "runs.jsonl")],
                            env=clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.fullmatch(r"epoch 1: \d+\.\d\d % \(held out\)\n", result.stdout)
    record = json.loads((tmp_path / "runs.jsonl").read_text())
    assert record["first_layer"] == "whitened-fixed" and record["mirror"] and 60 < record["accuracy"][0] < 100
    speed = subprocess.run([sys.executable, str(script), "--speed", "--rounds", "1", "--steps", "2"], env=clean_env(),
                           capture_output=True, text=True, timeout=600)
    assert speed.returncode == 0, speed.stderr[-3000:]
    assert len(re.findall(r"images/s, \d+\.\d\dx$", speed.stdout, re.M)) == 4

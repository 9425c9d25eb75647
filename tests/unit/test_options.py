"""ddpkit/options.py, at unit level: the command line built from mnist_ddp.py's Recipe and
RunOptions (its argparse groups, in --help's order, and the flags each holds), parse_options
and the one-line UsageError each bad value gets (an abbreviation among them; in the
script's own process: tests/runs/test_options_runs.py), --help without the testing aid, the {changeable} placeholder of
--allow-changes' help, option_args as the inverse of parse_options, and a recipe whose
option clashes with one of RunOptions.

    python -m pytest tests/unit/test_options.py
"""

import dataclasses
import re
import sys
from dataclasses import dataclass

import pytest

from ddpkit.launch import UsageError
from ddpkit.options import RunOptions, build_parser, check_run_options, option, option_args, parse_options
from mnist_ddp import Recipe


@dataclass(frozen=True)
class ToyRecipe:
    """A recipe of our own, so that the tests control its changeable options and its bool."""
    width: int = option(8, "width", "training", changeable=True)
    rate: float = option(0.5, "rate", "training", changeable=True)
    augment: bool = option(True, "augment the images", "data")
    name: str = option("toy", "name", "training")


@pytest.fixture(autouse=True)
def in_empty_directory(tmp_path, monkeypatch):
    """--data-dir's default, data/, is then missing (allowed), whatever directory pytest runs in."""
    monkeypatch.chdir(tmp_path)


def groups_and_flags(parser) -> dict[str, list[str]]:
    # argparse has no public way to list its groups; --help prints them in this order.
    return {g.title: [a.option_strings[0] for a in g._group_actions] for g in parser._action_groups
            if g.title not in ("positional arguments", "options")}


def test_the_groups_of_the_command_line_in_order():
    groups = groups_and_flags(build_parser(Recipe))
    assert list(groups) == ["data", "training", "distributed", "speed", "output", "checkpoints and preemption"]
    # The recipe's options come first in their group, then RunOptions' own.
    assert groups["data"] == ["--dataset", "--mirror-images", "--data-dir", "--node-data-dir", "--data-mirror", "--download-only",
                              "--data-feed", "--data-workers"]
    assert groups["training"][:2] == ["--model", "--epochs"]
    assert {"--global-batch", "--batch-size", "--lr", "--weight-decay", "--seed", "--max-steps"} <= set(groups["training"])
    assert groups["distributed"] == ["--backend", "--device", "--dist-timeout", "--hang-after", "--check"]
    assert groups["speed"] == ["--amp", "--channels-last", "--compile", "--deterministic", "--profile"]
    assert groups["output"] == ["--log-dir", "--run-name", "--run-dir", "--log-every", "--progress-every",
                                "--tracker", "--image-every"]
    assert groups["checkpoints and preemption"] == ["--resume", "--ckpt-every", "--ckpt-minutes", "--stop-before",
                                                    "--keep-ckpts", "--allow-changes", "--interrupt-at"]
    # Every recipe option is in the group its metadata names, under its kebab-case flag.
    for f in dataclasses.fields(Recipe):
        assert "--" + f.name.replace("_", "-") in groups[f.metadata["group"]], f.name


def test_help_shows_the_groups_and_defaults():
    text = build_parser(Recipe).format_help()
    headings = [text.index(f"\n{title}:\n") for title in
                ("data", "training", "distributed", "speed", "output", "checkpoints and preemption")]
    assert headings == sorted(headings)
    words = " ".join(text.split())
    assert "how many of the newest checkpoints to keep (default: 3)" in words
    assert "(default: )" not in words  # an empty default is not shown


def test_help_leaves_out_the_testing_aid_which_still_parses():
    text = build_parser(Recipe).format_help()
    assert "--interrupt-at" not in text and "--cuda-graphs" not in text
    assert parse_options(Recipe, ["--interrupt-at", "7:TERM"])[1].interrupt_at == "7:TERM"


def test_parse_options_returns_the_recipe_and_run_options():
    recipe, options = parse_options(Recipe, [])
    assert (recipe, options) == (Recipe(), RunOptions())
    recipe, options = parse_options(Recipe, ["--epochs", "3", "--lr", "0.01", "--amp", "--run-name", "exp-1",
                                             "--dist-timeout", "30"])
    assert type(recipe) is Recipe and type(options) is RunOptions
    assert (recipe.epochs, recipe.lr, options.amp, options.run_name, options.dist_timeout) == (3, 0.01, True, "exp-1", 30.0)


@pytest.mark.parametrize("argv, message", [
    # check_run_options
    (["--dist-timeout", "5"], "--dist-timeout must be from 10 to 604800 seconds (a week), got 5"),
    (["--dist-timeout", "nan"], "--dist-timeout must be a positive number of seconds, got nan"),
    (["--hang-after", "3"], "--hang-after must be 0 (a fifth of --dist-timeout), -1 (never) or from 5 s to below "
                            "--dist-timeout (300 s), got 3"),
    (["--hang-after", "30", "--dist-timeout", "30"], "--hang-after must be 0 (a fifth of --dist-timeout), -1 (never) or "
                                                     "from 5 s to below --dist-timeout (30 s), got 30"),
    (["--hang-after", "nan"], "--hang-after must be 0 (a fifth of --dist-timeout), -1 (never) or from 5 s to below "
                              "--dist-timeout (300 s), got nan"),
    (["--profile", "-1"], "--profile must be 0 (on request only) or a number of steps, got -1"),
    (["--data-workers", "-1"], "--data-workers must be 0 (read in the training process) or more, got -1"),
    (["--run-name", "a/b"], "--run-name must be one directory name of letters, digits and ._-+=,@ (no / or spaces, not . or ..), "
                            "got 'a/b'"),
    (["--run-name", ".."], "--run-name must be one directory name of letters, digits and ._-+=,@ (no / or spaces, not . or ..), "
                           "got '..'"),
    (["--run-name", "a", "--run-dir", "b"], "pass --run-name or --run-dir, not both"),
    (["--keep-ckpts", "0"], "--keep-ckpts must be at least 1, got 0"),
    (["--ckpt-minutes", "inf"], "--ckpt-minutes must be 0 (never) or a number of minutes, got inf"),
    (["--resume", "nowhere.pt"], "--resume nowhere.pt: no such checkpoint file; pass auto, never or an existing file"),
    (["--interrupt-at", "0:USR1"], "--interrupt-at must look like 120:USR1 or 120:TERM, got '0:USR1'"),
    (["--data-mirror", "ftp://x"], "--data-mirror must be an http://, https:// or file:// URL, got 'ftp://x'"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs --device cuda (or auto); use --backend gloo for CPUs"),
    # Recipe.check
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["--lr", "inf"], "--lr must be a positive number, got inf"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--seed", "10000000000001"], "--seed must be from -10000000000000 to 10000000000000, got 10000000000001"),
    (["--batch-size", "64", "--global-batch", "256"], "--batch-size 64 and --global-batch 256 both set the batch; pass "
     "one: --global-batch for the images per step over all ranks, --batch-size for the images per rank"),
    # argparse itself
    (["--epochs", "x"], "argument --epochs: invalid int value: 'x' (see --help)"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag (see --help)"),
    # an abbreviation is no option: it would read as another one once one is added
    (["--run-n", "x"], "unrecognized arguments: --run-n x (see --help)"),
    (["--ep", "3"], "unrecognized arguments: --ep 3 (see --help)"),
    (["--interrupt=3:USR1"], "unrecognized arguments: --interrupt=3:USR1 (see --help)"),
])
def test_each_bad_value_gets_one_exact_line(argv, message):
    with pytest.raises(UsageError) as refused:
        parse_options(Recipe, argv)
    assert str(refused.value) == message


def test_a_data_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError) as refused:
        parse_options(Recipe, ["--data-dir", "file"])
    assert str(refused.value) == "--data-dir file is not a directory"


def allow_changes_help(recipe_class) -> str:
    parser = build_parser(recipe_class)
    return next(a.help for a in parser._actions if "--allow-changes" in a.option_strings)


def test_allow_changes_help_names_the_changeable_options():
    assert allow_changes_help(ToyRecipe).startswith("resume even though --width, --rate differ from the checkpoint's")
    assert allow_changes_help(Recipe).startswith(
        "resume even though --epochs, --lr, --weight-decay, --max-steps differ from the checkpoint's")

    @dataclass(frozen=True)
    class Fixed:
        depth: int = option(2, "depth", "training")

    assert allow_changes_help(Fixed).startswith("resume even though (none) differ")
    assert "{changeable}" not in build_parser(Recipe).format_help()


def test_option_args_round_trips_through_parse_options(tmp_path):
    checkpoint = tmp_path / "ckpt-00000004.pt"
    checkpoint.write_bytes(b"")
    recipe = Recipe(dataset="fashion-mnist", epochs=3, lr=0.1 + 0.2, weight_decay=1e-5, seed=-7, ema=0.0)
    options = RunOptions(amp=True, channels_last=True, dist_timeout=12.5, progress_every=0.0, ckpt_minutes=0.25,
                         run_name="exp-1", resume=str(checkpoint), data_workers=0, interrupt_at="7:TERM")
    args = option_args(recipe, options)
    assert "--amp" in args and "0.30000000000000004" in args  # floats keep every digit
    assert parse_options(Recipe, args) == (recipe, options)
    assert option_args(Recipe(), RunOptions()) == []


def test_option_args_writes_a_bool_that_defaults_to_true_as_no_flag():
    toy = ToyRecipe(augment=False, width=16, rate=0.1)
    args = option_args(toy)
    assert args == ["--width", "16", "--rate", "0.1", "--no-augment"]
    assert parse_options(ToyRecipe, args)[0] == toy


def test_option_args_leaves_out_what_it_is_told_to():
    assert option_args(Recipe(epochs=3), RunOptions(amp=True, run_name="x"), leave_out=("run_name", "epochs")) == ["--amp"]


def test_option_args_round_trips_a_value_that_starts_with_a_dash():
    options = RunOptions(run_name="-x")
    assert parse_options(Recipe, ["--run-name=-x"])[1] == options  # a valid name
    assert parse_options(Recipe, option_args(options))[1] == options


def test_a_recipe_option_that_run_options_has_too_is_refused():
    @dataclass(frozen=True)
    class Clashing:
        epochs: int = option(1, "epochs", "training")
        amp: bool = option(False, "the recipe's own amp", "speed")

    with pytest.raises(TypeError, match=r"^recipe options that RunOptions has too: \{'amp'\}$"):
        build_parser(Clashing)


@pytest.mark.parametrize("argv", [["--batch-size", "64"], ["--global-batch", "256"]])
def test_a_continue_command_sets_the_batch_once_and_parses_back(argv):
    """option_args of a run that set one of the two batch options repeats that one alone,
    so the printed command is not refused for giving both."""
    recipe, options = parse_options(Recipe, argv)
    assert option_args(recipe) == argv
    assert parse_options(Recipe, option_args(recipe, options))[0] == recipe


def test_a_tracker_that_cannot_be_used_is_one_line_before_the_run_starts(monkeypatch):
    """--tracker mlflow without MLFLOW_TRACKING_URI (MLflow's default, a database in the working
    directory, would be another tracker for each submission directory), and a tracker whose
    package is missing (the run's aid for it: tests/runs/test_trackers_runs.py)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(UsageError, match=r"^--tracker mlflow needs MLFLOW_TRACKING_URI: a server \(http://host:5000\)"):
        check_run_options(RunOptions(tracker="mlflow"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    check_run_options(RunOptions(tracker="mlflow"))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UsageError, match=rf"^--tracker wandb needs the wandb package, which {re.escape(sys.executable)} "
                                         "lacks: pip install wandb$"):
        check_run_options(RunOptions(tracker="wandb"))


@pytest.mark.parametrize("uri", ["file:///project/mlruns", "/project/mlruns", "./mlruns"])
def test_mlflows_file_store_is_refused_before_the_run_where_mlflow_refuses_it(monkeypatch, uri):
    """MLflow 3.13 and later refuse their file store unless MLFLOW_ALLOW_FILE_STORE is true: the
    run would train with a tracker that gets nothing. A database or a server is taken."""
    import importlib.metadata
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.17.2")
    with pytest.raises(UsageError) as refused:
        check_run_options(RunOptions(tracker="mlflow"))
    assert str(refused.value) == (f"--tracker mlflow: MLFLOW_TRACKING_URI={uri} is MLflow's file store, which MLflow "
                                  "3.17.2 refuses: use a server (http://host:5000) or a database every node reaches "
                                  "(sqlite:////project/mlflow.db), or export MLFLOW_ALLOW_FILE_STORE=true to keep the "
                                  "file store")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_run_options(RunOptions(tracker="mlflow"))
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.12.1")
    check_run_options(RunOptions(tracker="mlflow"))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.17.2")
    for taken in ("sqlite:////project/mlflow.db", "http://mlflow.lab:5000", "https://mlflow.lab", "databricks"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", taken)
        check_run_options(RunOptions(tracker="mlflow"))


def test_mlflows_file_store_is_refused_where_mlflow_skinny_is_the_mlflow_installed(tmp_path, monkeypatch):
    """mlflow-skinny installs the mlflow package without an mlflow distribution: its version
    counts as MLflow's (here a stand-in for its files, the only place Python looks)."""
    (tmp_path / "mlflow").mkdir()
    (tmp_path / "mlflow" / "__init__.py").write_text("")
    (tmp_path / "mlflow_skinny-3.17.0.dist-info").mkdir()
    (tmp_path / "mlflow_skinny-3.17.0.dist-info" / "METADATA").write_text("Name: mlflow-skinny\nVersion: 3.17.0\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///project/mlruns")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(UsageError, match=r"^--tracker mlflow: MLFLOW_TRACKING_URI=file:///project/mlruns is MLflow's "
                                         r"file store, which MLflow 3\.17\.0 refuses: "):
        check_run_options(RunOptions(tracker="mlflow"))

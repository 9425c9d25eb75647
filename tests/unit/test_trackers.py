"""ddpkit/run/trackers.py with no tracker and no sender process: an epoch's scalars, a start's
text, tracker.json's entries (one per tracker and MLflow server however it is spelled, a URI
that cannot be read another server's, names looked up only for a new spelling, only those it
could be and for a short time, empty when missing, dropped with a line when of the wrong shape,
replaced whole), the HTTP errors docs/trackers.md says pass, rank 0's Tracker
(each start recorded, the steps the tracker has dropped, the final scalars sent unless it has
them, a new tracker run for a start that goes back with changed options), and the Sender
against a recording stand-in for MLflow's server put where trackers.TRACKERS names it: the
run opened once, hyperparameters and starts sent once, points in chunks of BATCH, a failing
tracker named once (an outage, or an error that does not pass by itself) and caught up when
it answers again, the run finished at the close, rank 0's lines read, the waiting points
capped and every epoch's kept.
(Against the real MLflow and W&B: tests/runs/test_trackers_runs.py.)

    python -m pytest tests/unit/test_trackers.py
"""

import json
import re
import socket
import threading
from pathlib import Path

import pytest

from ddpkit.job.contract import JobPaths
from ddpkit.run import trackers
from ddpkit.run.trackers import Sender, Start, Tracker, entry_name, epoch_scalars, read_entry, write_entry

AT = "2024-05-01 12:00:00 +0000"
HPARAMS = {"lr": 0.01, "batch_size": 64, "model": "cnn"}
RECORD = {"epoch": 1, "step": 40, "train_loss": 0.5, "test_loss": 0.4, "test_accuracy": 0.9, "test_f1": 0.88,
          "test_images": 10000, "lr": 0.01, "images_per_s": 5000.0, "epoch_s": 12.5, "peak_rss_mb": 900,
          "seconds_to_best": 12.5}


class FakeMLflow:
    """A recording stand-in for MLflow's server, with the API the sender calls on a tracker."""
    name, where = "FakeFlow", "http://tracker.test:5000"
    down = False  # (set by a test: every send then fails, as an unreachable server's does)

    def __init__(self, run_dir): self.calls = []
    @staticmethod  # noqa: E301
    def lasting(err): return isinstance(err, PermissionError)  # (as a refused password is)
    def link(self, run_id): return f"run {run_id}"
    def end(self, run_id, finished, code): self.calls.append(("end", run_id, finished, code))
    def close(self): self.calls.append(("close",))

    def open(self, run_id, run_name, tags):
        self.calls.append(("open", run_id, run_name, tags))
        return run_id or "run-1"

    def send(self, run_id, points, params, tags):
        if self.down:
            raise ConnectionError("connection refused\n(and a traceback's worth of detail)")
        self.calls.append(("send", run_id, list(points), dict(params), dict(tags)))


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "mlflow", FakeMLflow)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "run-a").mkdir()
    return tmp_path / "run-a"


def start_of(run_dir, step=0, world_size=1, changed="") -> Tracker:
    """Rank 0's Tracker for a start of the run (its sender never started)."""
    start = Start(job="", requeues=0, attempt="1/1", world_size=world_size, step=step, at=AT,
                  **({"changed": changed} if changed else {}))
    return Tracker("mlflow", run_dir, start=start, hparams=HPARAMS, identity={"run_dir": str(run_dir)})


def points(*steps, key="train/batch_loss", epoch=False) -> list[list]:
    """Points as rank 0 hands them over: [tag, value, step, milliseconds, whether an epoch's]."""
    return [[key, float(step), step, 1_000 + step, epoch] for step in steps]


def line(**message) -> str:
    """A line as rank 0 hands it to the sender."""
    return json.dumps({"points": [], **message})


def sender_of(run_dir, entry="mlflow") -> Sender:
    return Sender("mlflow", run_dir, entry)


def sends(sender) -> list[tuple]:
    return [call for call in sender.backend.calls if call[0] == "send"]


# ----------------------------------------------------------------------------- scalars and starts

def test_an_epoch_record_gives_its_scalars_in_tensorboards_order():
    scalars = epoch_scalars(RECORD)
    assert list(scalars) == ["train/loss", "test/loss", "test/accuracy", "test/f1", "train/lr", "speed/images_per_s",
                             "speed/epoch_s", "memory/peak_rss_mb", "time/seconds_to_best"]
    assert scalars["test/f1"] == 0.88 and scalars["memory/peak_rss_mb"] == 900.0
    assert all(isinstance(value, float) for value in scalars.values())


def test_the_test_image_count_is_no_scalar_and_gpu_figures_appear_only_when_recorded():
    assert "test/images" not in epoch_scalars(RECORD)
    assert not any(tag.startswith("gpu/") for tag in epoch_scalars(RECORD))
    on_gpu = epoch_scalars({**RECORD, "gpu_memory_gb": 2.5, "gpu_utilization": 80})
    assert [tag for tag in on_gpu if tag.startswith("gpu/")] == ["gpu/memory_gb", "gpu/utilization_percent"]


@pytest.mark.parametrize("job, requeues, text", [
    ("", 0, f"attempt 1/1, world size 2, from step 21, at {AT}"),
    ("42", 0, f"job 42, attempt 1/4, world size 2, from step 21, at {AT}"),
    ("42", 1, f"job 42 (requeued 1x), attempt 1/4, world size 2, from step 21, at {AT}"),
])
def test_the_text_of_a_start_outside_slurm_in_a_job_and_in_a_requeued_job(job, requeues, text):
    attempt = "1/4" if job else "1/1"
    assert Start(job=job, requeues=requeues, attempt=attempt, world_size=2, step=21, at=AT).text() == text


def test_each_mlflow_server_has_its_own_entry(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.lab:5000")
    assert entry_name("mlflow") == "mlflow http://mlflow.lab:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert entry_name("mlflow") == "mlflow"
    assert entry_name("wandb") == "wandb"


# ----------------------------------------------------------------------------- tracker.json

@pytest.mark.parametrize("text", [None, "", "{not json", "[1, 2]", '{"mlflow": [1]}', '{"mlflow": "run-1"}'])
def test_a_missing_or_broken_entry_reads_as_empty(tmp_path, text):
    path = tmp_path / JobPaths.TRACKER
    if text is not None:
        path.write_text(text)
    assert read_entry(path, "mlflow") == {}


def test_writing_an_entry_keeps_the_other_trackers_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / JobPaths.TRACKER
    write_entry(path, "wandb", {"run_id": "w1", "step": 5})
    write_entry(path, "mlflow", {"run_id": "m1"})
    write_entry(path, "mlflow", {"run_id": "m2", "step": 9})
    assert json.loads(path.read_text()) == {"wandb": {"run_id": "w1", "step": 5}, "mlflow": {"run_id": "m2", "step": 9}}
    assert read_entry(path, "mlflow") == {"run_id": "m2", "step": 9}
    assert [p.name for p in tmp_path.iterdir()] == [JobPaths.TRACKER]


# ----------------------------------------------------------------------------- rank 0's side

def test_each_start_of_the_run_is_recorded_in_its_entry(run_dir):
    start_of(run_dir, step=0, world_size=2)
    start_of(run_dir, step=40, world_size=4)
    starts = read_entry(run_dir / JobPaths.TRACKER, "mlflow")["starts"]
    assert [(s["step"], s["world_size"], s["at"]) for s in starts] == [(0, 2, AT), (40, 4, AT)]


def test_a_start_drops_the_points_of_steps_the_tracker_has(run_dir):
    write_entry(run_dir / JobPaths.TRACKER, "mlflow", {"run_id": "run-1", "step": 20})
    tracker = start_of(run_dir, step=10)
    assert tracker.has_up_to == 20
    for step in (10, 20, 21):
        tracker.point("train/batch_loss", 0.5, step, at_ms=7)
    tracker.add_epoch(RECORD)  # (step 40)
    assert tracker.points[0] == ["train/batch_loss", 0.5, 21, 7, False]
    assert all(p[4] for p in tracker.points[1:])  # (an epoch's: kept through an outage)
    assert {p[2] for p in tracker.points} == {21, 40} and len(tracker.points) == 1 + len(epoch_scalars(RECORD))


def test_the_end_of_a_run_adds_its_final_scalars_and_marks_it_finished(run_dir):
    tracker = start_of(run_dir)
    assert not tracker.finished
    tracker.finish({"test_accuracy": 0.99, "train_s": 60.0}, 940)
    assert [p[:3] for p in tracker.points] == [["final/test_accuracy", 0.99, 940], ["final/train_s", 60.0, 940]]
    assert tracker.finished


# ----------------------------------------------------------------------------- the sender

def test_the_sender_opens_the_run_once_and_a_later_start_reopens_it(run_dir, capsys):
    start_of(run_dir)
    sender = sender_of(run_dir)
    sender.take([line(identity={"run_dir": "/r"})])
    sender.send_waiting(False)
    sender.send_waiting(False)
    assert [c for c in sender.backend.calls if c[0] == "open"] == [("open", "", "run-a", {"run_dir": "/r"})]
    assert read_entry(run_dir / JobPaths.TRACKER, "mlflow")["run_id"] == "run-1"
    assert capsys.readouterr().out == "FakeFlow: run run-1\n"
    start_of(run_dir, step=40)
    later = sender_of(run_dir)
    later.send_waiting(False)
    assert later.backend.calls[0][:2] == ("open", "run-1")


def test_the_hyperparameters_and_each_start_are_sent_once(run_dir):
    start_of(run_dir, world_size=2)
    start_of(run_dir, step=40, world_size=4)
    sender = sender_of(run_dir)
    sender.take([line(hparams=HPARAMS, points=points(41))])
    sender.send_waiting(False)
    sender.take([line(points=points(42))])
    sender.send_waiting(False)
    first, second = sends(sender)
    assert first[3] == HPARAMS
    assert first[4] == {"start.1": f"attempt 1/1, world size 2, from step 0, at {AT}",
                        "start.2": f"attempt 1/1, world size 4, from step 40, at {AT}", "world_size": "4"}
    assert second[2:] == (points(42), {}, {})
    start_of(run_dir, step=42, world_size=1)
    later = sender_of(run_dir)
    later.take([line(hparams=HPARAMS)])
    later.send_waiting(False)
    assert [call[3:] for call in sends(later)] == [({}, {"start.3": f"attempt 1/1, world size 1, from step 42, at {AT}",
                                                          "world_size": "1"})]


def test_points_go_in_chunks_of_at_most_a_batch_and_the_entry_keeps_the_last_step(run_dir):
    start_of(run_dir)
    sender = sender_of(run_dir)
    sent = points(*range(1, 2 * trackers.BATCH + 501))
    sender.take([line(points=sent)])
    sender.send_waiting(False)
    assert [len(call[2]) for call in sends(sender)] == [trackers.BATCH, trackers.BATCH, 500]
    assert [p for call in sends(sender) for p in call[2]] == sent and sender.waiting == []
    assert read_entry(run_dir / JobPaths.TRACKER, "mlflow")["step"] == 2 * trackers.BATCH + 500
    assert start_of(run_dir, step=100).has_up_to == 2 * trackers.BATCH + 500


def test_a_failing_tracker_is_named_once_and_gets_what_waited_when_it_answers_again(run_dir, capsys, monkeypatch):
    start_of(run_dir)
    sender = sender_of(run_dir)
    sender.take([line(points=points(1, 2, 3))])
    monkeypatch.setattr(FakeMLflow, "down", True)
    sender.send_waiting(False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: the tracker FakeFlow at http://tracker.test:5000 failed "
                                                   "(ConnectionError: connection refused); training goes on")
    assert sender.waiting == points(1, 2, 3)
    sender.take([line(points=points(4))])
    sender.send_waiting(False)
    assert capsys.readouterr() == ("", "")
    monkeypatch.setattr(FakeMLflow, "down", False)
    sender.send_waiting(False)
    assert sends(sender)[0][2] == points(1, 2, 3, 4) and sender.waiting == []
    assert capsys.readouterr().out == ("the tracker FakeFlow at http://tracker.test:5000 answers again: "
                                       "it has every point up to step 4\n")
    sender.send_waiting(False)
    assert capsys.readouterr() == ("", "")


def test_the_close_tells_the_tracker_how_the_start_ended(run_dir):
    """Finished, or stopped to be continued (75), or failed: at the close alone."""
    start_of(run_dir)
    sender = sender_of(run_dir)
    sender.take([line(points=points(1)), line(finished=True, code=0)])
    sender.closing = False
    sender.send_waiting(False)
    assert not [call for call in sender.backend.calls if call[0] == "end"]
    sender.closing = True
    sender.serve()  # (returns: the lines have ended)
    assert sender.backend.calls[-2:] == [("end", "run-1", True, 0), ("close",)]
    stopped = sender_of(run_dir)
    stopped.take([line(points=points(2), code=75)])
    stopped.serve()
    assert stopped.backend.calls[-2:] == [("end", "run-1", False, 75), ("close",)]


def test_a_line_cut_short_by_rank_0s_death_is_left_out_and_the_sender_still_ends(run_dir):
    start_of(run_dir)
    sender = sender_of(run_dir)
    sender.take([line(points=points(1)), '{"points": [["train/batch_loss", 1.0, 2'])
    assert sender.closing and sender.waiting == points(1)
    sender.serve()
    assert sends(sender)[0][2] == points(1)


def test_the_sender_reads_rank_0s_lines_and_closes_at_their_end(run_dir):
    sender = sender_of(run_dir)
    closing_seen = []

    def lines():  # (as they come: closing is looked at after each)
        for message in ({"hparams": HPARAMS, "identity": {"run_dir": "/r"}}, {"points": points(1, 2)},
                        {"points": points(3), "finished": True}):
            yield line(**message)
            closing_seen.append(sender.closing)

    sender.take(lines())
    assert closing_seen == [False, False, False] and sender.closing and sender.wake.is_set()
    assert sender.waiting == points(1, 2, 3) and sender.finished
    assert sender.hparams == HPARAMS and sender.identity == {"run_dir": "/r"}


def test_the_points_that_wait_are_capped_the_oldest_per_step_ones_going_first(run_dir, monkeypatch, capsys):
    """While the tracker is down, the newest MAX_WAITING per-step points wait, and every epoch's."""
    monkeypatch.setattr(trackers, "MAX_WAITING", 5)
    monkeypatch.setattr(FakeMLflow, "down", True)
    start_of(run_dir)
    sender = sender_of(run_dir)
    epoch = points(2, key="test/accuracy", epoch=True)
    sender.take([line(points=points(1, 2) + epoch), line(points=points(4, 5, 6, 7))])
    sender.send_waiting(False)
    assert sender.waiting == points(2) + epoch + points(4, 5, 6, 7)
    capsys.readouterr()


def test_the_entry_never_passes_a_step_whose_points_are_not_all_sent(run_dir, monkeypatch):
    """A step split between two chunks, the second of which fails: the entry keeps the step
    before it, so that the next start sends its epoch again from metrics.jsonl."""
    start_of(run_dir)
    sender = sender_of(run_dir)
    sender.take([line(points=points(*[40] * trackers.BATCH) + points(40, key="test/accuracy", epoch=True))])
    calls = []

    def send_once(self, run_id, chunk, params, tags):
        calls.append(len(chunk))
        if len(calls) > 1:
            raise ConnectionError("connection refused")

    monkeypatch.setattr(FakeMLflow, "send", send_once)
    sender.send_waiting(False)
    assert calls == [trackers.BATCH, 1] and read_entry(run_dir / JobPaths.TRACKER, "mlflow")["step"] == 39
    assert sender.waiting == points(40, key="test/accuracy", epoch=True)


def test_during_a_long_outage_every_epoch_point_waits_whatever_the_cap(run_dir, monkeypatch, capsys):
    """The tracker down for many epochs, more epoch points than the cap on waiting per-step
    points: each epoch's point is sent once it answers, and only the newest per-step ones."""
    monkeypatch.setattr(trackers, "MAX_WAITING", 2)
    monkeypatch.setattr(FakeMLflow, "down", True)
    start_of(run_dir)
    sender = sender_of(run_dir)
    epochs = []
    for epoch in range(1, 7):  # (an epoch of 10 steps: a batch loss a step, then the epoch's points)
        epochs += points(10 * epoch, key="test/accuracy", epoch=True) + points(10 * epoch, key="train/loss", epoch=True)
        sender.take([line(points=points(*range(10 * epoch - 9, 10 * epoch + 1)) + epochs[-2:])])
        sender.send_waiting(False)
    monkeypatch.setattr(FakeMLflow, "down", False)
    sender.send_waiting(False)
    sent = [p for call in sends(sender) for p in call[2]]
    assert [p for p in sent if p[4]] == epochs and [p for p in sent if not p[4]] == points(59, 60)
    capsys.readouterr()


# ----------------------------------------------------------------------------- odd cases

@pytest.mark.parametrize("entry, problem", [
    ({"starts": {}}, "starts is {}"),
    ({"run_id": "run-1", "step": "10"}, "step is '10'"),
    ({"step": True}, "step is True"),
    ({"run_id": 7}, "run_id is 7"),
    ({"starts": [{"step": 3}]}, "a start is {'step': 3}"),
    ({"starts": [], "starts_sent": 2}, "starts_sent is 2 of 0 starts"),
    ([1], "a list, not an object"),
])
def test_an_entry_of_the_wrong_shape_is_dropped_with_a_line_and_the_start_goes_on(run_dir, capsys, entry, problem):
    """As metrics.jsonl's broken records are: a hand edit never stops a start with a traceback."""
    path = run_dir / JobPaths.TRACKER
    path.write_text(json.dumps({"mlflow": entry, "wandb": {"run_id": "w1"}}))
    tracker = start_of(run_dir, step=5)
    assert capsys.readouterr().err == (f"warning: dropping the entry 'mlflow' of {path}, which is not a whole entry "
                                       f"({problem}); the tracker gets a new run, with every epoch of metrics.jsonl\n")
    tracker.point("train/batch_loss", 0.5, 6)
    assert tracker.has_up_to == 0 and tracker.points[0][2] == 6
    state = read_entry(path, "mlflow")
    assert list(state) == ["starts"] and len(state["starts"]) == 1 and read_entry(path, "wandb") == {"run_id": "w1"}
    sender = sender_of(run_dir)
    sender.send_waiting(False)
    assert sender.backend.calls[0][:2] == ("open", "") and capsys.readouterr().err == ""


def test_the_final_figures_reach_a_tracker_that_missed_only_the_runs_end(run_dir):
    """The tracker has every epoch (to step 64) but not the final figures, which share the last
    epoch's step: a finished run started again sends them, once."""
    start_of(run_dir)
    write_entry(run_dir / JobPaths.TRACKER, "mlflow", {**read_entry(run_dir / JobPaths.TRACKER, "mlflow"),
                                                       "run_id": "run-1", "step": 64, "starts_sent": 1})
    again = Tracker("mlflow", run_dir, start=None, hparams={}, identity={})
    again.add_epoch({**RECORD, "step": 64})
    again.finish({"test_accuracy": 0.99, "train_loss": 0.1}, 64)
    assert [p[:3] for p in again.points] == [["final/test_accuracy", 0.99, 64], ["final/train_loss", 0.1, 64]]
    sender = sender_of(run_dir)
    sender.take([line(points=again.points, finished=True, final=64, code=0)])
    sender.serve()
    assert [p[0] for p in sends(sender)[0][2]] == ["final/test_accuracy", "final/train_loss"]
    assert sender.backend.calls[-2:] == [("end", "run-1", True, 0), ("close",)]
    assert read_entry(run_dir / JobPaths.TRACKER, "mlflow")["final"] == 64
    once_more = Tracker("mlflow", run_dir, start=None, hparams={}, identity={})
    once_more.finish({"test_accuracy": 0.99}, 64)
    assert once_more.points == [] and once_more.finished
    longer = start_of(run_dir, step=64)  # (--allow-changes --epochs: the run goes on, and ends later)
    longer.finish({"test_accuracy": 0.995}, 96)
    assert [p[:3] for p in longer.points] == [["final/test_accuracy", 0.995, 96]]


def test_a_start_that_goes_back_with_changed_options_opens_a_new_tracker_run(run_dir, capsys):
    """--resume FILE --allow-changes --lr: the steps after the checkpoint are trained again with
    other values, which the tracker's run, keeping each step once, would never show. A new run
    gets them, with the epochs up to the checkpoint; the earlier run keeps what it had."""
    start_of(run_dir, world_size=2)
    write_entry(run_dir / JobPaths.TRACKER, "mlflow", {**read_entry(run_dir / JobPaths.TRACKER, "mlflow"),
                                                       "run_id": "run-1", "step": 96, "final": 96, "params_sent": True,
                                                       "starts_sent": 1})
    same = start_of(run_dir, step=32)  # (no change: the same run, which keeps the values it got first)
    assert same.has_up_to == 96 and capsys.readouterr().out == ""
    tracker = start_of(run_dir, step=32, changed="--lr 0.01 -> 0.001")
    assert capsys.readouterr().out == ("FakeFlow: a new run, 'run-a from step 32', for the steps from 32 on with changed "
                                       "options; the run run-1 keeps its steps after 32 as they were first trained\n")
    tracker.add_epoch({**RECORD, "step": 32})
    tracker.point("train/batch_loss", 0.5, 40)
    tracker.finish({"test_accuracy": 0.9}, 96)
    assert {p[2] for p in tracker.points} == {32, 40, 96} and tracker.identity["earlier_run"].startswith("run-1 ")
    state = read_entry(run_dir / JobPaths.TRACKER, "mlflow")
    assert state["name"] == "run-a from step 32" and state["earlier"] == ["run-1"] and "run_id" not in state
    assert state["starts"][-1]["changed"] == "--lr 0.01 -> 0.001" and "step" not in state and "final" not in state
    sender = sender_of(run_dir)
    sender.take([line(hparams=HPARAMS, identity=tracker.identity, points=tracker.points)])
    sender.send_waiting(False)
    assert sender.backend.calls[0] == ("open", "", "run-a from step 32", tracker.identity)
    (sent,) = sends(sender)
    assert sent[3] == HPARAMS and sent[4]["start.3"] == f"attempt 1/1, world size 1, from step 32, changed: --lr 0.01 " \
                                                       f"-> 0.001, at {AT}" and len(sent[4]) == 4
    capsys.readouterr()
    later = start_of(run_dir, step=96, changed="--epochs 3 -> 4")  # (not back: the new run goes on)
    assert later.has_up_to == 96 and capsys.readouterr().out == ""


@pytest.mark.parametrize("uri, key", [
    ("http://mlflow.lab:5000/", "mlflow http://mlflow.lab:5000"),
    ("HTTP://MLflow.Lab:5000//", "mlflow http://mlflow.lab:5000"),
    ("https://me:secret@mlflow.lab:443/tracking/", "mlflow https://mlflow.lab/tracking"),
    ("http://[::1]:5000/", "mlflow http://[::1]:5000"),
    ("sqlite:////project/mlflow.db", "mlflow sqlite:////project/mlflow.db"),
])
def test_an_mlflow_servers_entry_is_one_spelling_of_it(monkeypatch, uri, key):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert entry_name("mlflow") == key


def test_the_same_server_by_another_name_keeps_the_entry_of_its_first_spelling(run_dir, monkeypatch):
    """A host name that resolves to the address of the first spelling (and its port) is that
    server; another port is another server."""
    path = run_dir / JobPaths.TRACKER
    write_entry(path, "mlflow http://127.0.0.1:5000", {"run_id": "run-1", "step": 40})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://LOCALHOST:5000/")
    tracker = start_of(run_dir, step=40)
    assert tracker.entry == "mlflow http://127.0.0.1:5000" and tracker.has_up_to == 40
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://localhost:5001")
    assert start_of(run_dir).entry == "mlflow http://localhost:5001"
    assert sorted(json.loads(path.read_text())) == ["mlflow http://127.0.0.1:5000", "mlflow http://localhost:5001"]


@pytest.mark.parametrize("unread, read", [("http://h:5000000", "http://127.0.0.1:5000"),
                                          ("http://[::1:5000", "http://127.0.0.1:5000"),
                                          ("http://127.0.0.1:5000", "http://localhost:99999")])
def test_a_uri_whose_port_or_host_cannot_be_read_is_another_server_and_the_start_goes_on(run_dir, monkeypatch, unread,
                                                                                          read):
    """A run started once with a port out of range (which MLflow names), then started again
    with the URI mended (or the other way round): the start goes on, with an entry of its own."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", unread)
    first = start_of(run_dir).entry
    monkeypatch.setenv("MLFLOW_TRACKING_URI", read)
    second = start_of(run_dir).entry
    assert second != first and sorted(json.loads((run_dir / JobPaths.TRACKER).read_text())) == sorted([first, second])


def test_a_new_spelling_looks_up_only_the_servers_it_could_be_and_never_waits_long_on_a_name(run_dir, monkeypatch):
    """Only the stored servers with the new spelling's scheme, port and path are looked up, and a
    name the resolver never answers for is given up (getaddrinfo has no time limit of its own: a
    stale name would cost the resolver's time-outs before training); the entry's own spelling
    looks up nothing."""
    path = run_dir / JobPaths.TRACKER
    for key in ("mlflow http://stale.test:5000", "mlflow http://other.test:5001", "mlflow https://other.test:5000",
                "mlflow http://other.test:5000/x", "wandb"):
        write_entry(path, key, {"run_id": key, "step": 40})
    asked, released, answered = [], threading.Event(), threading.Event()

    def getaddrinfo(host, port, *args, **kwargs):
        asked.append(host)
        if host == "localhost":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        if host == "stale.test":
            released.wait(20)  # (a resolver that never answers, until the test ends)
            answered.set()
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(trackers, "RESOLVE_SECONDS", 0.5, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://localhost:5000")
    try:
        entry = start_of(run_dir).entry
        gave_up = not answered.is_set()
    finally:
        released.set()
    assert entry == "mlflow http://localhost:5000" and gave_up and sorted(asked) == ["localhost", "stale.test"]
    asked.clear()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "HTTP://stale.test:5000/")
    assert start_of(run_dir).entry == "mlflow http://stale.test:5000" and asked == []


def test_the_docs_name_every_http_error_of_mlflow_that_passes():
    """docs/trackers.md lists the HTTP 4xx that MLflow.lasting counts as passing, all of them."""
    text = " ".join((Path(__file__).parents[2] / "docs" / "trackers.md").read_text().split())
    listed = re.search(r"an HTTP 4xx other than ((?:\d{3}, )*\d{3} and \d{3})", text)
    assert listed and tuple(int(code) for code in re.findall(r"\d{3}", listed[1])) == trackers.PASSING_HTTP


def test_an_error_that_does_not_pass_by_itself_is_named_as_such(run_dir, monkeypatch, capsys):
    """A refused credential (the stand-in's PermissionError) is no outage: the line says what to
    do, its end kept where the reason is long; an outage afterwards is named as one."""
    start_of(run_dir)
    sender = sender_of(run_dir)
    reason = "credentials refused " + "x" * 400 + " set MLFLOW_TRACKING_TOKEN to fix it"
    sending = FakeMLflow.send

    def refuse(self, *args):
        raise PermissionError(reason)

    monkeypatch.setattr(FakeMLflow, "send", refuse)
    sender.send_waiting(False)
    sender.send_waiting(False)
    err = capsys.readouterr().err
    assert err == (f"warning: the tracker FakeFlow at http://tracker.test:5000 refused this run (PermissionError: "
                   f"{reason[:200]} ... {reason[-200:]}), which does not pass by itself: training goes on without it; "
                   "mend this and start the run again, and the tracker gets every epoch it missed (from metrics.jsonl)\n")
    monkeypatch.setattr(FakeMLflow, "send", sending)
    monkeypatch.setattr(FakeMLflow, "down", True)
    sender.send_waiting(False)
    assert capsys.readouterr().err.startswith("warning: the tracker FakeFlow at http://tracker.test:5000 failed "
                                              "(ConnectionError: connection refused); training goes on")


@pytest.mark.slow  # (imports MLflow and W&B: seconds)
def test_the_real_trackers_errors_that_pass_and_those_that_do_not():
    """MLflow: a refusal (HTTP 4xx, its own checks) does not pass; an unreachable server, a
    time-out, a 5xx, a request limit do. W&B: a key or a project refused does not pass; its
    CommError does."""
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
    from wandb.errors import AuthenticationError, CommError, UsageError
    lasting = [RestException({"error_code": code, "message": "no"}) for code in
               ("PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")]
    lasting.append(MlflowException("The filesystem tracking backend ...", error_code=INVALID_PARAMETER_VALUE))
    passing = [RestException({"error_code": code, "message": "no"}) for code in
               ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED", "CANCELLED")]
    passing += [MlflowException("API request to http://h/api failed with exception ConnectionError"), OSError("down")]
    assert [trackers.MLflow.lasting(err) for err in lasting + passing] == [True] * len(lasting) + [False] * len(passing)
    assert [trackers.WandB.lasting(err) for err in (AuthenticationError("key"), UsageError("project"),
                                                    CommError("down"), OSError("down"))] == [True, True, False, False]

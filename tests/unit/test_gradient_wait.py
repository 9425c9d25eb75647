"""ddpkit/distributed.py's gradient_wait, the rule behind rank 0's line about waiting for the
other ranks (training_run's MOSTLY_WAITING): judged on DDP's runtime statistics of real
steps, the all-reduce that outlasts the backward pass is a wait, one mostly hidden behind it
is not, and nothing is judged before DDP timed a step. The line in real runs:
tests/runs/test_profiling.py.

    python -m pytest tests/unit/test_gradient_wait.py
"""


from ddpkit.distributed import gradient_wait
from ddpkit.run.training_run import MOSTLY_WAITING

# DDP's runtime statistics (DistributedDataParallel._get_ddp_logging_data(), times in ns) as
# real 2-rank Gloo runs on 2 CPU cores gave them: a 784-512-512-10 network at 4 images a rank
# (its big first layer's gradient comes last, so its all-reduce overlaps nothing), and
# mnist_ddp.py's CNN on 96 x 96 images at 4 images a rank.
WAITING = {"avg_forward_compute_time": 983737, "avg_backward_compute_time": 4393978,
           "avg_backward_comm_time": 9448740, "avg_backward_compute_comm_overlap_time": 2321908, "iteration": 9,
           "backend_name": "gloo", "world_size": 2}
COMPUTING = {"avg_forward_compute_time": 20420147, "avg_backward_compute_time": 75554318,
             "avg_backward_comm_time": 37069742, "avg_backward_compute_comm_overlap_time": 16322183, "iteration": 2,
             "backend_name": "gloo", "world_size": 2}


def test_the_wait_is_the_all_reduce_that_outlasts_the_backward_pass():
    share, compute_ms, wait_ms = gradient_wait(WAITING)
    assert abs(wait_ms - (9.448740 - 2.321908)) < 1e-9 and abs(compute_ms - (0.983737 + 4.393978)) < 1e-9
    assert abs(share - wait_ms / (wait_ms + compute_ms)) < 1e-12 and share > MOSTLY_WAITING


def test_an_all_reduce_mostly_hidden_behind_the_backward_pass_is_no_wait_to_speak_of():
    share, _, wait_ms = gradient_wait(COMPUTING)
    assert abs(wait_ms - (37.069742 - 16.322183)) < 1e-9 and share < MOSTLY_WAITING


def test_no_wait_is_judged_before_ddp_timed_a_step():
    assert gradient_wait({"iteration": 0, "backend_name": "gloo"}) is None
    assert gradient_wait({}) is None

"""The run wing: what happens around the recipe's steps, from the first to the last.

  training_run.py  the run's plan (batches, schedule) and TrainingRun: what happens around each step and epoch
  checkpoints.py   Progress, rotation, choosing and loading the checkpoint to resume
  recovery.py      the ranks' per-step agreement; lost peers and storage problems told apart
  stragglers.py    each rank's own time a step, and rank 0's judgement of which rank is slow
  profiling.py     --profile and RUN_DIR/profile-now: torch.profiler traces of every rank, the top operators
  weight_average.py --ema: the moving average of the weights that evaluation scores
  compile_cache.py --compile: torch's compile cache in the run's directory, saved once, loaded at every later start
  time_limit.py    the job's end: the stop --stop-before it, whether the run fits (standard library)
  rundir.py        the run's directory, held for as long as the run lives
  runlog.py        stdout, metrics.jsonl, TensorBoard (scalars, pictures, HParams)
  trackers.py      --tracker: MLflow or W&B as one run across every start, each step once, from a sender process
  doctor.py        --check: every rank joins and is described, a known-answer and a timed all-reduce, the
                   recipe's step timed on every rank and the links between nodes; what is slow, named
  storage_check.py --check's storage: each node's file system, a file seen across nodes, locks across nodes
"""

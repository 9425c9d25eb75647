"""ddpkit: the machinery mnist_ddp.py stands on. Nothing here needs editing to change the
data, the model or the training step; mnist_ddp.py holds those.

  launch.py        who this process is in the job, stop signals, the start-up clock, the exit files (standard library only)
  options.py       RunOptions and the command line (the recipe's options and these, in groups)
  distributed.py   the device and backend, the process group, --deterministic, labelled collectives
  staging.py       data sets fetched or copied into the data directories, under a lock
  imagesets.py     a data set's splits held in memory or streamed by a DataLoader; image folders
  checkpoints.py   atomic saves, Progress, rotation, choosing and loading the checkpoint to resume
  recovery.py      the ranks' per-step agreement; lost peers and storage problems told apart
  hangs.py         a hang in one line: each rank's watchdog, its stacks, ranks seen from /proc (standard library only)
  stragglers.py    each rank's own time a step, and rank 0's judgement of which rank is slow
  profiling.py     --profile and RUN_DIR/profile-now: torch.profiler traces of every rank, the top operators
  time_limit.py    the job's end: the stop --stop-before it, whether the run fits (standard library only)
  doctor.py        --check: every rank joins and is described, a known-answer and a timed all-reduce, the
                   recipe's step timed on every rank and the links between nodes; what is slow, named
  rundir.py        the run's directory, held for as long as the run lives
  runlog.py        stdout, metrics.jsonl, TensorBoard (scalars, pictures, HParams)
  trackers.py      --tracker: MLflow or W&B as one run across every start, each step once, from a sender process
  training_run.py  the run's plan (batches, schedule) and TrainingRun: what happens around each step and epoch
  jobs.py          the job runner: start-up, the run's start, every ending as an exit code, teardown
  sweeplines.py    a sweep file's lines and run names, for sweep.py and run_training.sbatch (Python 3.6, standard library)
  contract.py      what the job's supervisor, the ranks and sweep.py agree on: exit codes, the run's name, scontrol and
                   the requeue, the variables (JobEnv) and files (JobPaths) they pass (Python 3.6, standard library)
  supervisor/      the Slurm job's supervisor after run_training.sbatch: settings, the code's copy, the step,
                   restarts, the requeue, the line that continues (Python 3.6, standard library; no rank imports it)
"""

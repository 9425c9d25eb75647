"""ddpkit: the machinery mnist_ddp.py stands on. A copier reads mnist_ddp.py and api.py, the
face it imports, and nothing else: the data, the model and the training step live in the
recipe. The rest is kit, in wings by folder:

  api.py        the names the recipe uses, in one short list
  launch.py     who this process is in the job, stop signals, the start-up clock, the exit files (standard library)
  options.py    RunOptions and the command line (the recipe's options and these, in groups)
  distributed.py  the device and backend, the process group, --deterministic, labelled collectives
  hangs.py      a hang in one line: each rank's watchdog, its stacks, ranks seen from /proc (standard library)
  files.py      writes that a crash never leaves half done (standard library)
  jobs.py       the job runner: start-up, the run's start, every ending as an exit code, teardown
  data/         the data: staged under a lock, held in memory or streamed; image folders
  run/          one run's life: its plan and steps, checkpoints, agreement and recovery, the run log and
                trackers, stragglers, profiles, the time limit, the run's directory, --check (the doctor)
  job/          what the Slurm job's sides agree on (the contract) and a sweep file's lines
                (Python 3.6, standard library)
  supervisor/   the Slurm job's supervisor after run_training.sbatch (Python 3.6, standard library;
                imports only job/, and no rank imports it)

Each folder's __init__.py lists its modules.
"""

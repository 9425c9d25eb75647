"""The job wing: what the Slurm job's supervisor, the ranks and sweep.py agree on (Python 3.6,
standard library: the supervisor imports it).

  contract.py    exit codes, the run's name, scontrol and the requeue, the variables (JobEnv) and
                 files (JobPaths) the sides pass
  sweeplines.py  a sweep file's lines and run names, for sweep.py and run_training.sbatch
"""

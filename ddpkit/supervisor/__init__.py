"""The Slurm job's supervisor, which run_training.sbatch hands the job over to, on the host
with the node's python3 (3.6 or newer, standard library only). No rank imports it: what the
supervisor and the ranks agree on is ddpkit/job/contract.py.

  main.py      the entry file, run by path: the job from its START line to its END line (Supervisor),
               and `task`, what srun starts in each task
  settings.py  the settings from the environment, each checked; the container; a sweep's array task
  snapshot.py  the copy of the code the job runs, taken at its first start
  step.py      the ranks' check, command line and step (srun or torchrun); the resubmit line; the rendezvous
  outcome.py   what the ranks' exit codes mean (settle); how many nodes a step goes on with after a lost one
  nodes.py     which node a failure is pinned on, the nodes the job leaves out, and the step that comes
               next (next_step, first_step: the policy as plain values)
"""

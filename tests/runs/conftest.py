"""tests/runs/: real processes of the project's commands, started as users start them:
mnist_ddp.py plain, under torchrun or as srun starts its tasks (helpers.processes), sweep.py,
the benchmark, tensorboard.sh, torchrun_commands.sh."""

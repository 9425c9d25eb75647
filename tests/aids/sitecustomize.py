"""Python imports this file at the start of every process whose PYTHONPATH holds this folder
(the tests give it to every run they start; benchmarks/bench.py to its runs with and without
the per-step times): it brings in the testing aids of training_aids.py."""

import training_aids  # noqa: F401

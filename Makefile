# make run   - create .venv if missing, then train one process on the bundled MNIST sample
# make test  - create .venv if missing, install what the tests need (Python packages; as
#              root, Debian's Slurm, munge, shellcheck, openssh-server, bubblewrap, iptables and Fashion-MNIST), lint with
#              ruff, check the docs' figures, run the whole suite: tests/unit and tests/runs on every core
#              (pytest-xdist), then tests/cluster, the Slurm tests, as three pytest processes at once, one
#              per group (tests/cluster/one_node, own_clusters and mostly_waiting; their clusters listen on
#              fixed ports, so each group runs in one process), their lines prefixed with the group's name
# make test-slurm - the second part of make test alone: the Slurm groups at once (as root, once make
#              test has installed Slurm and the rest)
# make test-fast - the fast tier on every core: tests/unit and tests/runs without the longer end-to-end
#              runs (marked `slow` where they stand); no Slurm, network namespaces or sshd, no root
#              needed (docs/tests.md)
# make check-docs - the README's and docs' figures agree with docs/figures/ (benchmarks/figures.py)
# make mutants - install mutmut, mutate the launch environment, the job's contract (the port, the
#              ranks' codes, scontrol and the requeue), the time limit, the printed commands, the
#              device choice, the training run, the epoch's shards,
#              the training step, evaluation and build_training, and the sweep summary; run their
#              fast unit tests against each mutant, print the survivors and the score (docs/mutants.md)
# Variables: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
#            ARGS (extra options for `make run`, e.g. ARGS="--epochs 2"), WORKERS (pytest-xdist
#            workers for `make test` and `make test-fast`, default auto: one per CPU, at most 8),
#            JUNIT (a path prefix: pytest's JUnit XML files, PREFIX-not-slurm.xml and PREFIX-slurm-1.xml to
#            PREFIX-slurm-3.xml for `make test`, PREFIX-fast.xml for `make test-fast`; benchmarks/figures.py
#            tests reads them).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Each worker holds torch twice (itself and its preloaded fork server, tests/helpers/preloaded.py):
# about 1.5 GB.
WORKERS ?= auto
# worksteal: a worker whose tests are done takes the other's waiting ones, so the long runs
# do not queue behind one worker at the end.
XDIST   := -n $(WORKERS) --maxprocesses 8 --dist worksteal

.PHONY: run test test-slurm test-fast check-docs mutants

# The functions `make mutants` mutates (mutmut's names; ? stands for the ǁ around a class name).
MUTANTS := 'ddpkit.launch.x_expand_hostlist__*' 'ddpkit.job.contract.x_port_from_job_id__*' \
           'ddpkit.job.contract.x_read_codes__*' 'ddpkit.job.contract.x_show_job__*' 'ddpkit.job.contract.x_scontrol_show_job__*' \
           'ddpkit.job.contract.x_requeue_allowed__*' 'ddpkit.job.contract.x_requeue_job__*' \
           'ddpkit.launch.x_tasks_on_node__*' 'ddpkit.launch.x_gpus_granted__*' 'ddpkit.launch.x__int_var__*' \
           'ddpkit.launch.x_refuse_training_alone__*' 'ddpkit.launch.x_read_launch_env__*' \
           'ddpkit.launch.x_write_exit_file__*' 'ddpkit.launch.x_record_exit__*' 'ddpkit.launch.x_unfixable_exit__*' \
           'ddpkit.launch.x_exit_status__*' 'ddpkit.launch.x?StopSignals?*' \
           'ddpkit.run.time_limit.*' 'ddpkit.jobs.x_continue_command__*' 'ddpkit.jobs.x_launcher_words__*' \
           'mnist_ddp.x_epoch_shard__*' 'mnist_ddp.x_epoch_moves__*' \
           'sweep.x_exit_state__*' 'sweep.x_run_state__*' 'sweep.x_collect__*' 'sweep.x_summary_table__*' \
           'sweep.x_read_records__*' \
           'ddpkit.run.training_run.*' \
           'ddpkit.distributed.x_pick_device__*' 'ddpkit.distributed.x_invisible_gpu_cause__*' \
           'ddpkit.distributed.x_busy_gpu_cause__*' 'ddpkit.distributed.x_unusable_gpu_message__*' \
           'ddpkit.distributed.x_amp_warning__*' 'ddpkit.distributed.x_cuda_version__*' \
           'ddpkit.distributed.x_collective_of__*' 'ddpkit.distributed.x_nondeterministic_operation__*' \
           'mnist_ddp.x_evaluate__*' 'mnist_ddp.x_build_training__*' 'mnist_ddp.x_train_step__*'

run: $(VENV)/.installed
	$(PY) mnist_ddp.py $(ARGS)

# The Slurm groups run at once (docs/tests.md says what keeps them apart).
SLURM_GROUPS := one_node own_clusters mostly_waiting

test: $(VENV)/.installed-dev
	./local-slurm.sh install
	$(PY) -m ruff check .
	$(PY) benchmarks/figures.py
	$(PY) -m pytest $(XDIST) $(if $(JUNIT),--junitxml=$(JUNIT)-not-slurm.xml) tests/unit tests/runs
	$(MAKE) --no-print-directory test-slurm

# Each group's exit status goes to a file of its own: a background pipeline's status is lost
# once it has ended (bash keeps the status of its last command, sed), and a group may end
# long before the others.
test-slurm: SHELL := /bin/bash
test-slurm: $(VENV)/.installed-dev
	status=$$(mktemp -d); n=0; \
	for group in $(SLURM_GROUPS); do \
	    n=$$((n + 1)); \
	    { $(PY) -m pytest $(if $(JUNIT),--junitxml=$(JUNIT)-slurm-$$n.xml) tests/cluster/$$group 2>&1; \
	      echo $$? > "$$status/$$group"; } | sed -u "s/^/[$$group] /" & \
	done; \
	wait; failed=0; \
	for group in $(SLURM_GROUPS); do \
	    code=$$(cat "$$status/$$group" 2>/dev/null || echo none); \
	    echo "Slurm tests: $$group exit $$code"; test "$$code" = 0 || failed=1; \
	done; \
	rm -rf "$$status"; test $$failed = 0

test-fast: $(VENV)/.installed-dev
	$(PY) -m pytest $(XDIST) -m "not slow" $(if $(JUNIT),--junitxml=$(JUNIT)-fast.xml) tests/unit tests/runs

check-docs: $(VENV)/.installed
	$(PY) benchmarks/figures.py

# mutmut writes mutants/ (a copy of the code, one mutant at a time switched on); it starts
# afresh each time. Timeouts count as killed, as mutmut's own score counts them. Each mutant
# runs in a process forked from mutmut's, which has run torch: with OpenMP threads there the
# child's first parallel operation hangs (a timeout, not a verdict), hence one thread.
mutants: $(VENV)/.installed-dev
	$(PY) -m pip install --quiet mutmut==3.8.1
	rm -rf mutants && mkdir mutants
	OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children $$(nproc) $(MUTANTS) > mutants/run.log 2>&1 || (tail -n 40 mutants/run.log; false)
	$(VENV)/bin/mutmut results --all true | awk -F': ' '$$2 != "not checked" { n++; if ($$2 == "killed" || $$2 == "timeout") k++; else print } \
	    END { printf "mutants killed: %d of %d (%.1f %%)\n", k, n, 100 * k / n }'

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

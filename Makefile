# make run   - create .venv if missing, then train one process on the bundled MNIST sample
# make test  - create .venv if missing, install what the tests need (Python packages; as
#              root, Debian's Slurm, munge, shellcheck, openssh-server, bubblewrap, iptables and Fashion-MNIST), lint with
#              ruff, run the whole suite
# Variables: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
#            ARGS (extra options for `make run`, e.g. ARGS="--epochs 2").

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: run test

run: $(VENV)/.installed
	$(PY) mnist_ddp.py $(ARGS)

test: $(VENV)/.installed-dev
	./local-slurm.sh install
	$(PY) -m ruff check .
	$(PY) -m pytest tests

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

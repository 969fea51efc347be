# Two commands on a fresh clone: `make train` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the pytest workers of make test and make test-slow (pytest-xdist): a test's forked ranks wait on
# each other, and imports and subprocess launches leave a core idle; two keep both cores busy
WORKERS ?= 2

.PHONY: train test test-slow lint install clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,plot,tensorboard]"
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow -n $(WORKERS) $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) out

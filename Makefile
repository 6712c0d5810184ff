# `make demo` and `make test` work on a fresh machine: each sets up .venv first (once).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export ROS_LOG_DIR ?= $(CURDIR)/out/ros_log

.PHONY: demo test test-under-load bench venv

venv: $(STAMP)

$(STAMP): requirements.txt setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vla-demo

# Two processes, whole modules each (their fixtures and ROS domains are per module): 523-643 s against
# 700-874 s in one on the 2-core VM (BENCHMARKS.md, thirty-third and thirty-fourth sessions).
PYTEST_SUITE := -q -rs -n 2 --dist loadfile test
LOAD ?= 3

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_SUITE)

# `make test` with LOAD busy loops beside it (scripts/under_load.sh ends them with the run).
test-under-load: $(STAMP)
	scripts/under_load.sh $(LOAD) 1 $(PYTEST_SUITE)

bench: $(STAMP)
	$(VENV)/bin/vla-bench --preset tiny --device cpu --modes eager,static,ctxkv,fused --json out/bench_tiny.json

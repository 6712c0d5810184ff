# `make demo` and `make test` work on a fresh machine: each sets up .venv first (once).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export ROS_LOG_DIR ?= $(CURDIR)/out/ros_log

.PHONY: demo test bench venv

venv: $(STAMP)

$(STAMP): requirements.txt setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vla-demo

test: $(STAMP)
	$(PY) -m pytest -q -rs --timeout=600 test

bench: $(STAMP)
	$(VENV)/bin/vla-bench --preset tiny --device cpu --modes eager,static,ctxkv,fused --json out/bench_tiny.json

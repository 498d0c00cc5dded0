# KVCompass developer entry points. `make help` lists them.
# Every target creates its own virtual environment (.venv) and is safe to re-run.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))

.DEFAULT_GOAL := help

.PHONY: help
help: ## list the targets
	@grep -E '^[a-z][a-z0-9_-]*:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  make %-12s %s\n", $$1, $$2}'

$(VENV)/.tools: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q 'maturin>=1.7,<2'
	touch $@

.PHONY: build
build: $(VENV)/.tools ## build the Rust extension (release) into .venv with the test extras
	$(VENV)/bin/maturin develop --release -q --extras test

.PHONY: demo
demo: build ## the main job: a local multi-region cluster replays a conversation-trace slice, KVCompass vs region-local routing
	$(VENV)/bin/kvcompass cluster-demo

.PHONY: test
test: build ## all tests: cargo test (core, proptest) then pytest (bindings, hypothesis, stubtest)
	cargo test --quiet
	$(PY) -m pytest -q

.PHONY: bench-quick
bench-quick: build ## benches/bench_core.py --quick (<= 60 s, 10^6 entries); prints one JSON line
	$(PY) benches/bench_core.py --quick

.PHONY: bench
bench: build ## full benchmark (10^7 entries), the pytest-benchmark suite of the bindings, and the criterion benches
	$(VENV)/bin/maturin develop --release -q --extras test,bench
	$(PY) benches/bench_core.py
	$(PY) -m pytest benches/test_bench_core.py --benchmark-only -p no:cacheprovider
	cargo bench

.PHONY: fuzz
fuzz: ## cargo fuzz targets (needs a nightly toolchain and cargo-fuzz; not run in CI)
	cd fuzz && cargo +nightly fuzz run patch_decode -- -max_total_time=600
	cd fuzz && cargo +nightly fuzz run snapshot_state -- -max_total_time=600
	cd fuzz && cargo +nightly fuzz run field_ops -- -max_total_time=600

.PHONY: clean
clean: ## remove build outputs and the virtual environment
	rm -rf $(VENV) target .pytest_cache .hypothesis

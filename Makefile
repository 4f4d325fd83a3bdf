# One command each: `make demo` runs the main job end to end, `make test` passes the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# every extra of pyproject.toml but tpu (TPU VM workers only): the tests, the demo, every command
EXTRAS := dev,docs,tokenizers,parquet,chat,plot,train,beam,dask,metrics,gcs

.PHONY: setup test test-fast test-multiprocess test-maxtext demo megatron-example docs lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

# the tests on every core (at most 4 workers), a file per worker at a time: its module
# fixtures are set up once; in collection order, where tests/conftest.py puts the files with
# multi-process tests first (xdist would otherwise start the files with the most tests first)
PARALLEL := -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

# the 15 slowest tests are listed at the end: the suite's time is watched (under 12 minutes)
test: setup
	$(BIN)/python -m pytest -q $(PARALLEL) --durations=15

test-fast: setup
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not multiprocess"

test-multiprocess: setup
	$(BIN)/python -m pytest -q $(PARALLEL) -m multiprocess

# Opt-in, not part of `make test`: MaxText's real trainer in its own Python 3.12 venv
# (.venv-maxtext), with `pipeline maxtext install`, kill -9 + resume, elastic 2 -> 1, a switch,
# a skip (bare, and at a step across restarts), a seq_len switch, a take-down (exclude), packed
# SFT (MaxText's loss weights) and a data error on one of 2 processes stopping both.
# MAXTEXT=~/maxtext: a GitHub checkout of MaxText instead of the maxtext package.
test-maxtext:
	$(PYTHON) scripts/test_maxtext.py $(if $(MAXTEXT),--maxtext $(MAXTEXT))

demo: setup
	$(BIN)/python scripts/demo.py

# the data of configs/megatron-in-place.yaml: python-docs as a Megatron dataset, indexed
megatron-example: setup
	$(BIN)/python scripts/megatron_example.py

# the site of docs/ (mkdocs.yml) into site/, strictly: a broken link or anchor, a missing
# reference or a public name without a docstring or an API entry fails (tests/test_docs.py)
docs: setup
	$(BIN)/python -m mkdocs build --strict

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# the issue's stores: builtin python-code, a three-source mixture, synthetic; the packed-SFT
# rows, which are the same whatever the store, once (with the last)
bench: setup
	$(BIN)/python -m pipeline bench --store python-code --no-sft
	$(BIN)/python -m pipeline bench --store mixture --no-scale --no-sft
	$(BIN)/python -m pipeline bench --no-scale
	$(BIN)/python benchmarks/mixture_bench.py

clean:
	rm -rf $(VENV) .venv-maxtext .venv-maxtext-checkout data runs site .pytest_cache

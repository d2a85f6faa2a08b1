# tiertrain: set-up, the default job, tests.
#   make train      - create .venv, install, run the default main job
#   make test       - create .venv if needed, lint and type-check, run the whole test suite
#   make test-fast  - the tests that spawn no process and take seconds (a couple of minutes)
#   make lint       - ruff (lint and format), mypy in full on the public seams and for calls,
#                     attributes and names on the whole package
PYTHON ?= python3
VENV   ?= .venv
# The CPU build here; on a CUDA machine: make setup TORCH_SPEC="torch>=2.11"
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-fast lint bench-io clean
# test workers (pytest-xdist): one per CPU and one more, since the tests wait on the disk and on
# their child processes part of the time (the whole parallel stage on the 2-core VM: 730 s with
# 2 workers, 599 s with 3); the tests marked serial run after them, alone
JOBS ?= $(shell echo $$(( $$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1) + 1 )))

# The torch spec the venv was set up with: rewritten (and the venv brought up to date) only
# when TORCH_SPEC changes, so `make train TORCH_SPEC=...` on an existing .venv takes effect.
TORCH_STAMP := $(VENV)/.torch-spec

.PHONY: FORCE
$(TORCH_STAMP): FORCE
	@mkdir -p $(VENV)
	@[ "$$(cat $@ 2>/dev/null)" = '$(TORCH_SPEC)' ] || echo '$(TORCH_SPEC)' > $@

$(STAMP): pyproject.toml $(TORCH_STAMP)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/tiertrain train $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check tiertrain tests bench examples
	$(BIN)/ruff format --check tiertrain tests bench examples
	@# one run: the whole package for calls, attributes and names, the public seams in full
	@# (pyproject.toml's [tool.mypy])
	$(BIN)/mypy

# Every stage runs whatever an earlier one gave (a lint error or a failed parallel test never
# hides the serial tests' result); each stage's status is printed, and make fails if any failed
# (pytest's 5, no test selected, is not a failure: PYTEST_ARGS may select a part).
test: $(STAMP)
	@lint=0; par=0; ser=0; \
	$(MAKE) --no-print-directory lint || lint=$$?; \
	$(BIN)/python -m pytest -q -n $(JOBS) -m "not serial" $(PYTEST_ARGS) || par=$$?; \
	$(BIN)/python -m pytest -q -m serial $(PYTEST_ARGS) || ser=$$?; \
	[ $$par = 5 ] && par=0; [ $$ser = 5 ] && ser=0; \
	echo "make test: lint $$([ $$lint = 0 ] && echo passed || echo FAILED)," \
	     "parallel tests $$([ $$par = 0 ] && echo passed || echo FAILED)," \
	     "serial tests $$([ $$ser = 0 ] && echo passed || echo FAILED)"; \
	[ $$lint = 0 ] && [ $$par = 0 ] && [ $$ser = 0 ]

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) -m "not slow and not serial" $(PYTEST_ARGS)

bench-io: $(STAMP)
	$(BIN)/tiertrain bench io --path ./tiertrain-scratch

clean:
	rm -rf tiertrain-scratch runs

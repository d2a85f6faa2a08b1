# tiertrain: set-up, the default job, tests.
#   make train   - create .venv, install, run the default main job
#   make test    - create .venv if needed, run the test suite
PYTHON ?= python3
VENV   ?= .venv
# The CPU build here; on a CUDA machine: make setup TORCH_SPEC="torch>=2.11"
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup train test bench-io clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench-io: $(STAMP)
	$(BIN)/tiertrain bench io --path ./tiertrain-scratch

clean:
	rm -rf tiertrain-scratch runs

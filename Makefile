# captionflow: the two commands of the README.
#   make run        set up .venv (CPU stack) and run the flow on the built-in model and demo set
#   make test       set up .venv (CPU stack) and the Debian packages the tests use, lint, run every test (CI)
#   make test-fast  the tests not marked slow (no vLLM engine, no end-to-end flow)
#   make lint       ruff: lint and formatting
# FLAVOUR=gpu installs the CUDA build of vLLM instead (on a GPU host).

PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
FLAVOUR ?= cpu
VENV ?= .venv
PIP := $(VENV)/bin/python -m pip
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed-$(FLAVOUR)

.PHONY: install run test test-fast lint docs lock clean system-deps

install: $(STAMP)

$(STAMP): requirements/$(FLAVOUR).lock pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24"
ifeq ($(FLAVOUR),cpu)
	# torch's CPU build: from pip's configured indexes / find-links, else from PyTorch's CPU index
	$(PIP) install -q --no-deps "torch==2.13.0+cpu" || \
	  $(PIP) install -q --no-deps --extra-index-url $(TORCH_CPU_INDEX) "torch==2.13.0+cpu"
endif
	# the lock is complete and pinned: --no-deps installs exactly it (see requirements/overrides.txt)
	$(PIP) install -q --no-deps -r requirements/$(FLAVOUR).lock
	$(PIP) install -q --no-deps --no-build-isolation -e .
	# the checkout's own bytecode, once: where PYTHONDONTWRITEBYTECODE is set, every process (each Ray worker, each
	# engine) compiled captionflow's modules from source at every start (~0.3 s of CPU each)
	$(VENV)/bin/python -m compileall -q -j 0 captionflow flows tasks deployments > /dev/null
ifeq ($(FLAVOUR),cpu)
	$(VENV)/bin/python -m captionflow.compat.torchvision_ops
endif
	$(VENV)/bin/python -c "import vllm, ray, prefect, torchvision; print('stack ok: vllm', vllm.__version__, 'ray', ray.__version__, 'prefect', prefect.__version__)"
	touch $(STAMP)

run: install
	$(VENV)/bin/captionflow run

# The tests on TEST_WORKERS processes at once (pytest-xdist; a module's tests stay on one worker, with its
# fixtures; the modules in the order tests/conftest.py gives them): most of a test's time is one busy process (a
# vLLM engine on one core, a Prefect or Ray start-up), so on CI's 2 cores one worker left a core idle about half
# the time.
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: install system-deps lint
	$(PYTEST) --durations=40

# Programs the tests run for real and pip cannot install: Prometheus (scrapes a real run) and Chromium
# (renders the HTML report). Installed with apt where missing (as root, or through sudo).
# Each is a Debian package and the command it installs.
SYSTEM_DEPS := prometheus chromium
system-deps:
	@missing=""; for pkg in $(SYSTEM_DEPS); do command -v $$pkg >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	  echo "installing$$missing (Debian packages the tests use)"; \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends $$missing; \
	fi

test-fast: install system-deps lint
	$(PYTEST) -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rewrite the generated reference pages (docs/parameters.md, docs/quarantine.md) from the code.
docs: install
	$(VENV)/bin/python docs/generate.py

# Recompile the locks (needs `uv`); see requirements/overrides.txt for why overrides exist.
lock:
	uv pip compile requirements/cpu.in --override requirements/overrides.txt --override requirements/overrides-cpu.txt \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --find-links /opt/wheels \
	  --index-strategy unsafe-best-match --no-header -o requirements/cpu.lock
	uv pip compile requirements/gpu.in --override requirements/overrides.txt \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header -o requirements/gpu.lock
	UV_PYTHON_DOWNLOADS=never uv pip compile requirements/gpu-host.in --override requirements/overrides.txt \
	  --override requirements/overrides-gpu-host.txt --constraint requirements/gpu-host-constraints.txt \
	  --python-version 3.12 --python-platform x86_64-manylinux_2_28 --no-header -o requirements/gpu-host.lock

clean:
	rm -rf $(VENV) captionflow-out

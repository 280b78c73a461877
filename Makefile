# captionflow: the two commands of the README.
#   make run    set up .venv (CPU stack) and run the flow on the built-in model and demo set
#   make test   set up .venv (CPU stack) and run the test suite
# FLAVOUR=gpu installs the CUDA build of vLLM instead (on a GPU host).

PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
FLAVOUR ?= cpu
VENV ?= .venv
PIP := $(VENV)/bin/python -m pip
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed-$(FLAVOUR)

.PHONY: install run test lock clean

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
ifeq ($(FLAVOUR),cpu)
	$(VENV)/bin/python -m captionflow.torchvision_compat
endif
	$(VENV)/bin/python -c "import vllm, ray, prefect, torchvision; print('stack ok: vllm', vllm.__version__, 'ray', ray.__version__, 'prefect', prefect.__version__)"
	touch $(STAMP)

run: install
	$(VENV)/bin/captionflow run

test: install
	$(VENV)/bin/python -m pytest -q

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

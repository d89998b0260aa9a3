# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use
# and reuse it afterwards (the stamp is rebuilt when pyproject.toml or constraints-dev.txt
# changes). The venv gets the exact versions of constraints-dev.txt.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   := work/demo
JOBS   ?= 2
# Files holding tests marked `timing`: the serial pass collects only these.
TIMING := $(shell grep -rlE 'pytest\.mark\.timing' tests)

.PHONY: demo test test-gpu lint venv clean multihost-deps report-deps

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints-dev.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	bash examples/demo.sh $(PY) $(DEMO)

# Two passes: everything else on $(JOBS) workers, then the wall-clock and page-fault asserts
# (marker `timing`) alone, so that the other tests' load cannot distort them.
test: $(STAMP) multihost-deps report-deps
	$(PY) -m ruff check zerotron tests bench examples
	$(PY) -m ruff format --check zerotron tests bench examples
	$(PY) -m pytest -q -n $(JOBS) -m 'not timing' tests
	$(PY) -m pytest -q -n 0 -m timing $(TIMING)

# The multi-host tests (tests/distributed/test_multinode.py) start real sshd, pdsh and mpirun in
# network namespaces: install Debian's packages when they are missing (needs root and apt-get).
MULTIHOST_PKGS := openssh-server openssh-client pdsh openmpi-bin mpich
multihost-deps:
	@missing=""; for p in $(MULTIHOST_PKGS); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing for the multi-host tests:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
	  echo "multi-host tests need:$$missing (apt-get install as root); they are skipped without root"; \
	fi

# The report test (tests/test_report.py) opens `zerotron report`'s page in headless Chromium:
# install Debian's chromium when it is missing (needs root and apt-get).
REPORT_PKGS := chromium
report-deps:
	@missing=""; for p in $(REPORT_PKGS); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing for the report test:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
	  echo "the report test needs:$$missing (apt-get install as root); it fails without it"; \
	fi

# tests/cuda/ (never part of `make test`) on this machine's GPU. It installs nothing from the
# network: the Python is .venv's when there is one, else GPU_PYTHON (default python3, e.g. a
# machine image's own venv holding a CUDA torch); wheels in GPU_WHEELS (default .whl/, for
# zerotron's dependencies that Python lacks, e.g. pydantic on an offline machine) are installed
# offline into .gpu-site/ first. Fails, saying why, when no CUDA device is visible.
GPU_PYTHON ?= python3
GPU_WHEELS ?= .whl
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(GPU_PYTHON))
test-gpu:
	@$(GPU_PY) -c 'import torch' 2>/dev/null || { \
	  echo "make test-gpu: $(GPU_PY) cannot import torch; run \`make venv\` with a CUDA torch," \
	    "or set GPU_PYTHON to a Python that has one"; exit 1; }
	@$(GPU_PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' || { \
	  $(GPU_PY) -c 'import torch; print("make test-gpu: no CUDA device visible to torch", \
	    torch.__version__, "(CUDA build:", torch.version.cuda, "); run it on a machine with" \
	    " an NVIDIA GPU and a CUDA build of torch")'; exit 1; }
	@if ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then \
	  $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --upgrade \
	    --target .gpu-site $(GPU_WHEELS)/*.whl; fi
	ZEROTRON_GPU_TESTS=1 PYTHONPATH=$(CURDIR):$(CURDIR)/.gpu-site$${PYTHONPATH:+:$$PYTHONPATH} \
	  $(GPU_PY) -m pytest -q -n 0 -p no:cacheprovider tests/cuda

lint: $(STAMP)
	$(PY) -m ruff check zerotron tests bench examples
	$(PY) -m ruff format --check zerotron tests bench examples

clean:
	rm -rf work

# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use
# and reuse it afterwards (the stamp is rebuilt only when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   := work/demo
JOBS   ?= 2

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	bash examples/demo.sh $(PY) $(DEMO)

test: $(STAMP)
	$(PY) -m ruff check zerotron tests bench examples
	$(PY) -m pytest -q -n $(JOBS) tests

lint: $(STAMP)
	$(PY) -m ruff check zerotron tests bench examples

clean:
	rm -rf work

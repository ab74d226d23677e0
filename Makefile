# ddbench: `make test` sets up .venv and runs the tests; `make bench` runs the main job.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# torch: reuse the machine's own (a GPU box has one); otherwise the CPU build pinned here
TORCH_PIN := torch==2.13.0

.PHONY: install test test-all bench gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "reusing this machine's torch"; $(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV) && $(VPY) -m pip install -q $(TORCH_PIN); \
	fi
	$(VPY) -m pip install -q -e '.[test]'
	@touch $@

test: install
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -m "not gpu and not slow"

test-all: install
	$(VPY) -m pip install -q -e '.[test,serve]'
	TRITON_INTERPRET=1 $(VPY) -m pytest -q

bench: install
	$(VPY) -m ddbench moe-sweep

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache

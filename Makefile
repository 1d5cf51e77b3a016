# m3gate: every target installs what it needs on a fresh machine.
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
CACHE   ?= $(HOME)/.cache/m3gate
export M3GATE_CACHE := $(CACHE)

.PHONY: venv demo docs test test-fast clients redis vllm-env tiny-model vllm-up bench clean schema prometheus chromium haproxy dashboards-png chaos fuzz soak contract

$(BIN)/m3gate: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip >/dev/null
	$(BIN)/pip install -q -e '.[test]'
	@# xds-protos (the picker's ext_proc stubs) ships its own, older copies of opentelemetry-proto's modules, which
	@# break the OTLP exporters wherever pip installed them last: put opentelemetry-proto's own files back.
	$(BIN)/pip install -q --force-reinstall --no-deps "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	touch $(BIN)/m3gate

venv: $(BIN)/m3gate

demo: venv
	$(BIN)/m3gate demo

redis:
	@scripts/ensure-redis.sh

# The documentation site (docs/, mkdocs.yml) into site/. --strict: a broken link, a missing page or a stale
# generated reference fails the build; `make test` runs it. Offline: the theme ships its assets.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# Every tool a test runs is installed first; M3GATE_REQUIRE_TOOLS=1 makes a test whose tool is still missing FAIL
# instead of skipping (tests/support/tools.py).
test: venv docs redis vllm-env prometheus chromium haproxy clients
	M3GATE_REQUIRE_TOOLS=1 $(BIN)/python -m pytest -q -ra --durations=30 -m "not vllm_pd and not vllm_own"
	M3GATE_REQUIRE_TOOLS=1 $(BIN)/python -m pytest -q -ra --durations=10 -m "vllm_pd or vllm_own"

test-fast: venv redis prometheus chromium haproxy clients
	M3GATE_REQUIRE_TOOLS=1 M3GATE_SKIP_VLLM=1 $(BIN)/python -m pytest -q -ra -m "not vllm"

# The client matrix (tests/clients, docs/clients.md): the OpenAI Agents SDK, LangChain, LiteLLM, GuideLLM and
# inference-perf, each in its own virtualenv under $(CACHE)/clients with the versions pinned in
# tests/clients/requirements-NAME.txt.
clients:
	@scripts/install-clients.sh

# Prometheus + promtool (Debian package): the observability tests run a real one.
prometheus:
	@scripts/install-prometheus.sh

# Debian's chromium + chromedriver: the browser tests (tests/ui) drive /ui and the contract report headless.
chromium:
	@scripts/install-chromium.sh

# Debian's haproxy: the compose test checks the stack's load balancer config with `haproxy -c`.
haproxy:
	@scripts/install-haproxy.sh

# The operating contract of the compose deployment and its SLO rules (regenerated from deploy/compose/pools.yaml).
contract: venv
	$(BIN)/m3gate contract deploy/compose/pools.yaml --out deploy/contract --rules deploy/prometheus/slo/m3gate-slo.yml

# PNGs of the Grafana dashboard's panels from a short simulated run, into loadtests/results/dashboards/.
dashboards-png: venv prometheus
	$(BIN)/python -m loadtests.assets.render_dashboards

schema: venv
	$(BIN)/m3gate config schema > deploy/m3gate.schema.json

# Short versions of every benchmark (gateway overhead, routing policies, harness self-check, the other loadtests
# benches), results under loadtests/results/, a summary table at the end (under about five minutes).
bench: venv
	$(BIN)/python -m loadtests.bench --quick

# Reliability suites, figures in docs/reliability.md (short versions run in `make test`; -m "not soak" skips one).
# chaos: every failure scenario under load through two gateways sharing a private Redis (about 3 minutes);
# fuzz: 10,000 hostile/malformed cases and connection attacks (about 6 minutes); soak: 30 minutes of mixed load.
chaos: venv redis
	$(BIN)/python -m loadtests.robustness.chaos

fuzz: venv redis
	$(BIN)/python -m loadtests.robustness.fuzz --cases 10000

soak: venv redis
	$(BIN)/python -m loadtests.robustness.soak --minutes 30

clean:
	rm -rf $(VENV) .pytest_cache loadtests/results

# Real vLLM (CPU build) in its own virtualenv under $(CACHE); the gateway never imports it.
VLLM_PY := $(CACHE)/vllm-venv/bin/python

vllm-env:
	@scripts/install-vllm.sh

tiny-model: vllm-env
	@out=$$($(VLLM_PY) -m pools.vllm_local.tiny_model 2>&1) || { echo "$$out" >&2; exit 1; }

vllm-up: venv tiny-model
	$(BIN)/python -m pools.vllm_local.launcher --max-model-len 2048 4096 8192

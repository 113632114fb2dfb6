# turnd — run `make` to list the targets.
.DEFAULT_GOAL := help
CARGO ?= cargo
PYTHON ?= python3
# The project's own Python environment: make never installs into the system Python
# (Debian's and Ubuntu's refuse that, PEP 668).
VENV := $(CURDIR)/target/venv
VPY := $(VENV)/bin/python
NPM ?= npm
TS_SDK := sdk/typescript
# Any pip call outside a virtual environment fails instead of touching the system.
export PIP_REQUIRE_VIRTUALENV := true
NEXTEST := $(shell command -v cargo-nextest >/dev/null 2>&1 && echo yes)
# `make install` (see docs/operations.md): where things go. DESTDIR is prepended to
# every path (for packaging); INSTALL_BIN is the binary installed.
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
SYSCONFDIR ?= /etc
UNITDIR ?= $(SYSCONFDIR)/systemd/system
INSTALL_BIN ?= target/release/turnd
# The installed binary carries no debug info (a tenth of the size); the debug info is
# installed apart, where gdb and perf look for it by the binary's debug link.
DEBUGDIR ?= /usr/lib/debug
OBJCOPY ?= objcopy

.PHONY: help build release install run venv browser test check-repo test-rust test-python test-sdk-python test-sdk-typescript test-iii lint lint-sdk-python lint-sdk-typescript bench-sdk-typescript bench-external bench-external-ab bench-callgrind bench-restate fmt doc bench check-fsync powerloss sim sim-planted fuzz clean ui-screenshots sdk test-cluster test-cluster-long bench-cluster bench-cluster-throughput bench-failover

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## Build every crate and the turnd binary (debug)
	$(CARGO) build --workspace --all-targets

release: ## Build the release binary target/release/turnd
	$(CARGO) build --release --locked -p turnd

install: ## Install the release binary to PREFIX/bin (default /usr/local; its debug info apart, under DEBUGDIR), the systemd unit, and the example config unless one exists; honours DESTDIR
	@test -x $(INSTALL_BIN) || { echo "make install: no $(INSTALL_BIN): run 'make release' first (as your user, then 'sudo make install')" >&2; exit 1; }
	install -d -m 0755 $(DESTDIR)$(BINDIR) $(DESTDIR)$(DEBUGDIR)$(BINDIR)
	$(OBJCOPY) --only-keep-debug $(INSTALL_BIN) $(DESTDIR)$(DEBUGDIR)$(BINDIR)/turnd.debug
	chmod 0644 $(DESTDIR)$(DEBUGDIR)$(BINDIR)/turnd.debug
	$(OBJCOPY) --strip-debug --add-gnu-debuglink=$(DESTDIR)$(DEBUGDIR)$(BINDIR)/turnd.debug $(INSTALL_BIN) $(DESTDIR)$(BINDIR)/turnd.tmp
	chmod 0755 $(DESTDIR)$(BINDIR)/turnd.tmp
	mv $(DESTDIR)$(BINDIR)/turnd.tmp $(DESTDIR)$(BINDIR)/turnd
	install -d -m 0755 $(DESTDIR)$(UNITDIR)
	sed 's|/usr/local/bin/turnd|$(BINDIR)/turnd|g; s|/etc/turnd/|$(SYSCONFDIR)/turnd/|g; s|/etc/default/turnd|$(SYSCONFDIR)/default/turnd|g' \
		deploy/systemd/turnd.service > $(DESTDIR)$(UNITDIR)/turnd.service.tmp
	chmod 0644 $(DESTDIR)$(UNITDIR)/turnd.service.tmp
	mv $(DESTDIR)$(UNITDIR)/turnd.service.tmp $(DESTDIR)$(UNITDIR)/turnd.service
	@# An existing configuration is the operator's: never overwritten.
	test -e $(DESTDIR)$(SYSCONFDIR)/turnd/turnd.toml || install -D -m 0644 config/turnd.toml $(DESTDIR)$(SYSCONFDIR)/turnd/turnd.toml
	test -e $(DESTDIR)$(SYSCONFDIR)/default/turnd || install -D -m 0600 deploy/default/turnd $(DESTDIR)$(SYSCONFDIR)/default/turnd
	@echo "installed $(DESTDIR)$(BINDIR)/turnd; next: systemctl daemon-reload && systemctl enable --now turnd (docs/operations.md)"

run: ## Run the daemon (release build) on its embedded defaults (ws 127.0.0.1:7420, admin :7421, data in ./data); ARGS="…" go to `turnd serve`
	$(CARGO) run --release -p turnd -- serve $(ARGS)

test: check-repo test-rust test-python test-sdk-python test-sdk-typescript test-iii ## Run the whole test suite

# The one build of the daemon every test target uses. It builds the Rust SDK's
# examples with it (the end-to-end tests run them): cargo unifies features over the
# packages of one build, so a build of the binary alone would be another build of
# the daemon and much of what it depends on, made again by each test target.
BUILD_DAEMON := $(CARGO) build -p turnd --bin turnd -p turnd-client --examples

TEST_ENV := TURND_BIN=$(CURDIR)/target/debug/turnd TURND_FAULTFS_LIB=$(CURDIR)/target/debug/libturnd_faultfs.so TURND_EXAMPLES_DIR=$(CURDIR)/target/debug/examples

browser: ## Debian's chromium and chromium-driver for the browser tests of the operator page (apt-get when missing)
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; else \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y --no-install-recommends chromium chromium-driver; \
	fi

ui-screenshots: browser ## Screenshots of every screen of the operator page into docs/ (headless Chromium)
	TURND_UI_SCREENSHOTS=$(CURDIR)/docs $(CARGO) test -p turnd-tests --test browser every_screen_loads_in_chromium

test-rust: browser venv ## Rust unit and end-to-end tests (the end-to-end tests spawn target/debug/turnd and the SDK's examples, some with the turnd-faultfs library preloaded; the browser tests run headless Chromium; the cluster's tests run the venv's nats-server)
	$(BUILD_DAEMON)
	$(CARGO) build -p turnd-faultfs
ifeq ($(NEXTEST),yes)
	$(TEST_ENV) $(CARGO) nextest run --workspace --no-fail-fast
else
	$(TEST_ENV) $(CARGO) test --workspace --no-fail-fast
endif

bench-cluster: venv ## What a sequential turn costs on a 3-node cluster (3 nats-server R=3 sync always, release turnd, the caller and worker built release too), through the leader and forwarded; TURNS=500
	$(CARGO) build --release -p turnd --bin turnd
	TURND_BIN=$(CURDIR)/target/release/turnd TURNS=$(or $(TURNS),500) $(CARGO) nextest run --release -p turnd-tests --test cluster --run-ignored only --no-capture measure_sequential_turns

bench-cluster-throughput: venv ## The 3-node cluster's throughput beside one node's (release turnd; SESSIONS=64 closed loops for SECS=10), with CPU per turn by process
	$(CARGO) build --release -p turnd --bin turnd
	TURND_BIN=$(CURDIR)/target/release/turnd SESSIONS=$(or $(SESSIONS),64) SECS=$(or $(SECS),10) $(CARGO) nextest run -p turnd-tests --test cluster --run-ignored only --no-capture measure_throughput

test-cluster: venv ## The cluster's end-to-end tests alone: three nats-server and three turnd processes on loopback, a node behind trimmed streams copying a checkpoint, watches relayed across a failover, a node added and one removed under load, the operator page on a node, and one seeded fault schedule with the history checker (also part of test-rust); CLUSTER_SEED=n replays a seed
	$(BUILD_DAEMON)
	$(TEST_ENV) $(CARGO) nextest run -p turnd-tests --test cluster --test cluster_trim --test cluster_watch --test cluster_members --test cluster_page --test cluster_iii --test cluster_faults --no-fail-fast

# Each seeded target has its own default for SEEDS (one `SEEDS ?=` would set both).
CLUSTER_SEEDS := 1,2,3
FAULTS ?= 12
test-cluster-long: venv ## Longer seeded fault schedules on the cluster, each checked: SEEDS=1,2,3 (or SEEDS=random:N), FAULTS=12 per seed
	$(BUILD_DAEMON)
	$(TEST_ENV) SEEDS=$(or $(SEEDS),$(CLUSTER_SEEDS)) FAULTS=$(FAULTS) $(CARGO) nextest run -p turnd-tests --test cluster_faults --run-ignored only --no-capture seeded_faults_long

bench-failover: venv ## How long a killed node's partitions take to serve again (alone, and with a NATS server killed too), and what a rolling restart fails; RUNS=10
	$(BUILD_DAEMON)
	$(TEST_ENV) RUNS=$(or $(RUNS),10) $(CARGO) nextest run -p turnd-tests --test cluster_faults --run-ignored only --no-capture measure_failover

venv: $(VENV)/.ready ## The project's Python environment (target/venv) with every Python test dependency

$(VENV)/.ready: tests/python/requirements.txt sdk/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
	$(VPY) -m pip install --quiet --disable-pip-version-check -e './sdk/python[dev]'
	touch $@

test-python: venv ## The independent Python protocol client against the built binary
	$(BUILD_DAEMON)
	$(VPY) tests/python/test_protocol.py --turnd target/debug/turnd

test-sdk-python: venv ## The Python SDK's tests (sdk/python/tests) against the built binary
	$(BUILD_DAEMON)
	cd sdk/python && TURND_BIN=$(CURDIR)/target/debug/turnd $(VPY) -m pytest -q tests

# The iii endpoint's tests drive the real iii SDKs, pinned: npm iii-sdk@0.22.1
# (tests/iii/node/package-lock.json) and PyPI iii-sdk==0.25.0 (tests/python/requirements.txt).
III_NODE := tests/iii/node
$(III_NODE)/node_modules/.ci-stamp: $(III_NODE)/package-lock.json $(III_NODE)/package.json
	cd $(III_NODE) && $(NPM) ci --no-audit --no-fund
	touch $@

test-iii: venv $(III_NODE)/node_modules/.ci-stamp ## iii-sdk workers and callers (npm 0.22.1, PyPI 0.25.0) against turnd's iii endpoint
	$(BUILD_DAEMON)
	cd $(III_NODE) && TURND_BIN=$(CURDIR)/target/debug/turnd node --test --test-concurrency=2 --test-timeout=60000 --test-force-exit *.test.mjs
	TURND_BIN=$(CURDIR)/target/debug/turnd $(VPY) -m pytest -q tests/iii/python

lint: lint-sdk-python lint-sdk-typescript ## fmt check, clippy with warnings denied, the Python and TypeScript SDKs' checks, and the repository checks
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(MAKE) --no-print-directory check-repo

check-repo: ## Fast repository checks: only target/venv's pip, the stated minimum Rust, relative links in the docs, code size
	scripts/check-make-pip.sh
	scripts/check-msrv.py
	scripts/check-docs.py
	scripts/check-code-size.py

lint-sdk-python: venv ## mypy --strict and ruff (lint and format) on sdk/python and examples/python
	cd sdk/python && $(VENV)/bin/mypy --strict
	cd sdk/python && $(VENV)/bin/ruff check --config pyproject.toml . ../../examples/python
	cd sdk/python && $(VENV)/bin/ruff format --check --config pyproject.toml . ../../examples/python

# npm ci again only when the lock file changed.
$(TS_SDK)/node_modules/.ci-stamp: $(TS_SDK)/package-lock.json $(TS_SDK)/package.json
	cd $(TS_SDK) && $(NPM) ci --no-audit --no-fund
	touch $@

SDK_OUT := target/sdk

sdk: venv $(TS_SDK)/node_modules/.ci-stamp ## The installable SDKs in target/sdk/: the npm tarball (built dist/, `ws` its one dependency) and the Python wheel
	rm -rf $(SDK_OUT) $(TS_SDK)/dist
	mkdir -p $(SDK_OUT)
	cd $(TS_SDK) && $(NPM) pack --pack-destination $(CURDIR)/$(SDK_OUT)
	$(VPY) -m pip wheel --quiet --disable-pip-version-check --no-deps ./sdk/python -w $(SDK_OUT)
	@ls -l $(SDK_OUT)

test-sdk-typescript: $(TS_SDK)/node_modules/.ci-stamp ## The TypeScript SDK's tests (node --test) against the built binary
	$(BUILD_DAEMON)
	cd $(TS_SDK) && npx tsc -p tsconfig.json && npx tsc -p tsconfig.test.json
	cd $(TS_SDK) && TURND_BIN=$(CURDIR)/target/debug/turnd node --test --test-concurrency=4 --test-timeout=120000 --test-force-exit build/sdk/typescript/test/*.test.js

lint-sdk-typescript: $(TS_SDK)/node_modules/.ci-stamp ## tsc --noEmit (strict) and Biome over the TypeScript SDK
	cd $(TS_SDK) && npx tsc -p tsconfig.test.json --noEmit
	$(TS_SDK)/node_modules/.bin/biome lint --error-on-warnings

bench-sdk-typescript: $(TS_SDK)/node_modules/.ci-stamp ## One Node worker's throughput, 100 sessions of one-step echo turns (release build)
	$(CARGO) build --release -p turnd --bin turnd
	cd $(TS_SDK) && npx tsc -p tsconfig.json && npx tsc -p tsconfig.test.json
	cd $(TS_SDK) && node build/sdk/typescript/bench/throughput.js --binary $(CURDIR)/target/release/turnd --sessions 100 --turns 20

# The external driver: a release daemon started by the bench, Node callers and one Node
# worker process (the TypeScript SDK), the daemon's CPU read from /proc. BENCH_TURND
# names another build to measure (an older binary for an A/B comparison).
SESSIONS ?= 1000
TURNS ?= 20
MESSAGES ?= 0
BENCH_TURND ?= $(CURDIR)/target/release/turnd
bench-external: $(TS_SDK)/node_modules/.ci-stamp ## Turns/s, the daemon's and the driver's CPU per turn, one session's p50/p99: SESSIONS (1000) x TURNS (20) from Node callers and worker against a release turnd (or BENCH_TURND); MESSAGES=N gives each turn an agent's input of N chat messages
	@if [ "$(BENCH_TURND)" = "$(CURDIR)/target/release/turnd" ]; then $(CARGO) build --release -p turnd --bin turnd; fi
	cd $(TS_SDK) && npx tsc -p tsconfig.json && npx tsc -p tsconfig.test.json
	cd $(TS_SDK) && node build/sdk/typescript/bench/throughput.js --binary $(BENCH_TURND) --sessions $(SESSIONS) --turns $(TURNS) --messages $(MESSAGES)

# Instructions per turn under valgrind's callgrind: a count that moves little with
# the machine's load, for changes too small to show in CPU time (docs/benchmarks.md).
# turnd-bench is built apart with rustix's libc backend (rustix's vDSO lookup faults
# under valgrind 3.19); CG_BENCH=PATH measures another build's turnd-bench instead.
CG_ARGS ?= --sessions 200 --turns 10 --apply-delay-ms 10000
CG_BENCH ?=
CG_TARGET := $(CURDIR)/target/callgrind
bench-callgrind: ## Instructions per turn of `turnd-bench sessions` (CG_ARGS) under callgrind, the whole process, and its top functions; CG_BENCH=PATH for another build's turnd-bench
	@command -v valgrind >/dev/null || { echo "bench-callgrind needs valgrind (apt-get install valgrind)"; exit 2; }
	@mkdir -p $(CG_TARGET)
	@if [ -z "$(CG_BENCH)" ]; then RUSTFLAGS="--cfg rustix_use_libc" CARGO_TARGET_DIR=$(CG_TARGET) $(CARGO) build --release -p turnd-bench; fi
	valgrind --tool=callgrind --callgrind-out-file=$(CG_TARGET)/callgrind.out $(or $(CG_BENCH),$(CG_TARGET)/release/turnd-bench) sessions $(CG_ARGS) > $(CG_TARGET)/sessions.out 2> $(CG_TARGET)/valgrind.log
	$(PYTHON) scripts/callgrind-per-turn.py $(CG_TARGET)/callgrind.out $(CG_TARGET)/sessions.out

# Builds measured against each other by the external driver, interleaved round by
# round (bench/ab.ts): BUILDS="old=/tmp/old/turnd new=target/release/turnd", ROUNDS
# (6) runs of each, AB_ENV="new:TURND_STORAGE__SYNC=never" for settings of one build,
# AB_DRIVER="old:/tmp/sdk/build/sdk/typescript/bench/throughput.js" for the driver of
# another build of the SDK (its callers and worker) with one build.
ROUNDS ?= 6
BUILDS ?=
AB_ENV ?=
AB_DRIVER ?=
bench-external-ab: $(TS_SDK)/node_modules/.ci-stamp ## Builds of turnd against each other under the external driver, interleaved: BUILDS="a=PATH b=PATH" (labels and binaries), ROUNDS (6), SESSIONS x TURNS, AB_ENV="b:KEY=VALUE" settings of one build, AB_DRIVER="a:PATH" another SDK build's throughput.js for one, MESSAGES as for bench-external; mean, range and rounds lower of each
	@if [ -z "$(BUILDS)" ]; then echo 'name the builds: make bench-external-ab BUILDS="old=/tmp/old/turnd new=target/release/turnd"'; exit 2; fi
	cd $(TS_SDK) && npx tsc -p tsconfig.json && npx tsc -p tsconfig.test.json
	cd $(TS_SDK) && node build/sdk/typescript/bench/ab.js --base $(CURDIR) $(foreach b,$(BUILDS),--build $(b)) $(foreach e,$(AB_ENV),--env $(e)) $(foreach d,$(AB_DRIVER),--driver $(d)) --rounds $(ROUNDS) --sessions $(SESSIONS) --turns $(TURNS) --messages $(MESSAGES)

# The same load shape against Restate (bench/restate/drive.mjs: the npm restate-server
# and the Restate TypeScript SDK, pinned in its package-lock.json), for a comparison
# with bench-external in the same hour of the machine.
RESTATE_BENCH := bench/restate
$(RESTATE_BENCH)/node_modules/.ci-stamp: $(RESTATE_BENCH)/package-lock.json $(RESTATE_BENCH)/package.json
	cd $(RESTATE_BENCH) && $(NPM) ci --no-audit --no-fund
	touch $@

bench-restate: $(RESTATE_BENCH)/node_modules/.ci-stamp ## bench-external's load (SESSIONS x TURNS) against Restate 1.7 (npm restate-server), its server's CPU from /proc
	cd $(RESTATE_BENCH) && node drive.mjs --sessions $(SESSIONS) --turns $(TURNS)

fmt: ## Format the code
	$(CARGO) fmt --all

doc: ## Build the API docs
	$(CARGO) doc --workspace --no-deps

bench: ## Benchmarks (release build; see docs/benchmarks.md for each scenario's command)
	$(CARGO) build --release -p turnd -p turnd-bench
	target/release/turnd-bench sequential
	target/release/turnd-bench sessions
	target/release/turnd-bench multistep

check-fsync: venv ## Prove from strace that an fdatasync precedes every acknowledgement
	CHECK_PY=$(VPY) scripts/check-fsync.sh

# The long power-loss exploration (docs/powerloss.md). `make test` runs a fixed set of
# cuts; this checks every sync point of a scripted run per seed, and random cuts under
# load, within POWERLOSS_BUDGET_S seconds per seed and test.
POWERLOSS_SEEDS ?= 1..4
POWERLOSS_CUTS ?= 20
POWERLOSS_BUDGET_S ?= 1200
powerloss: ## Power-loss exploration of the real binary: every sync point of a scripted run for each of POWERLOSS_SEEDS (default 1..4, POWERLOSS_BUDGET_S each), and POWERLOSS_CUTS random cuts under load per seed (docs/powerloss.md)
	$(BUILD_DAEMON)
	$(CARGO) build -p turnd-faultfs
	$(TEST_ENV) POWERLOSS_SEEDS=$(POWERLOSS_SEEDS) POWERLOSS_CUTS=$(POWERLOSS_CUTS) POWERLOSS_BUDGET_S=$(POWERLOSS_BUDGET_S) \
		$(CARGO) test -p turnd-tests --test powerloss -- --nocapture --test-threads=1

SIM_SEEDS := 0..1000
SIM_PLANTED := planted-ack-before-commit planted-reconcile-skips-finished planted-stop-keeps-lock

sim: ## Explore simulator seeds SEEDS (default 0..1000, e.g. make sim SEEDS=0..100000) on every core, release build; SIM_ARGS="…" go to turnd-sim (docs/simulator.md)
	$(CARGO) run --release -p turnd-sim -- --seeds $(or $(SEEDS),$(SIM_SEEDS)) $(SIM_ARGS)

sim-planted: ## The simulator against each of its planted bugs: the seeds named for each must break an invariant (docs/simulator.md)
	@for f in $(SIM_PLANTED); do \
		echo "== turnd-sim --features $$f"; \
		$(CARGO) test -p turnd-sim --features $$f --test seeds -- --nocapture || exit 1; \
	done

fuzz: ## Run the cargo-fuzz targets (FUZZ_SECONDS each, default 60; see docs/fuzzing.md)
	scripts/fuzz.sh

clean: ## Remove build output
	$(CARGO) clean

# `make print-env-VAR` prints VAR as the recipes see it in their environment (used by
# scripts/check-make-pip.sh).
print-env-%:
	@printenv $* || true

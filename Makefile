# turnd — run `make` to list the targets.
.DEFAULT_GOAL := help
CARGO ?= cargo
PYTHON ?= python3
# The project's own Python environment: make never installs into the system Python
# (Debian's and Ubuntu's refuse that, PEP 668).
VENV := $(CURDIR)/target/venv
VPY := $(VENV)/bin/python
NEXTEST := $(shell command -v cargo-nextest >/dev/null 2>&1 && echo yes)

.PHONY: help build run venv browser test test-rust test-python lint fmt doc bench check-fsync fuzz clean ui-screenshots

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## Build every crate and the turnd binary (debug)
	$(CARGO) build --workspace --all-targets

run: ## Run the daemon on its embedded defaults (ws 127.0.0.1:7420, admin :7421, data in ./data)
	$(CARGO) run --release -p turnd -- serve

test: test-rust test-python ## Run the whole test suite

TEST_ENV := TURND_BIN=$(CURDIR)/target/debug/turnd TURND_FAULTFS_LIB=$(CURDIR)/target/debug/libturnd_faultfs.so

browser: ## Debian's chromium and chromium-driver for the browser tests of the operator page (apt-get when missing)
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; else \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y --no-install-recommends chromium chromium-driver; \
	fi

ui-screenshots: browser ## Screenshots of every screen of the operator page into docs/ (headless Chromium)
	TURND_UI_SCREENSHOTS=$(CURDIR)/docs $(CARGO) test -p turnd-tests --test browser every_screen_loads_in_chromium

test-rust: browser ## Rust unit and end-to-end tests (the end-to-end tests spawn target/debug/turnd, some with the turnd-faultfs library preloaded; the browser tests run headless Chromium)
	$(CARGO) build -p turnd --bin turnd
	$(CARGO) build -p turnd-faultfs
ifeq ($(NEXTEST),yes)
	$(TEST_ENV) $(CARGO) nextest run --workspace --no-fail-fast
else
	$(TEST_ENV) $(CARGO) test --workspace --no-fail-fast
endif

venv: $(VENV)/.ready ## The project's Python environment (target/venv) with every Python test dependency

$(VENV)/.ready: tests/python/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
	touch $@

test-python: venv ## The independent Python protocol client against the built binary
	$(CARGO) build -p turnd --bin turnd
	$(VPY) tests/python/test_protocol.py --turnd target/debug/turnd

lint: ## fmt check and clippy with warnings denied
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt: ## Format the code
	$(CARGO) fmt --all

doc: ## Build the API docs
	$(CARGO) doc --workspace --no-deps

bench: ## Benchmarks (release build; see docs/benchmarks.md for each scenario's command)
	$(CARGO) build --release -p turnd -p turnd-bench
	target/release/turnd-bench sequential
	target/release/turnd-bench sessions
	target/release/turnd-bench multistep

check-fsync: ## Prove from strace that an fdatasync precedes every acknowledgement
	scripts/check-fsync.sh

fuzz: ## Run the cargo-fuzz targets (FUZZ_SECONDS each, default 60; see docs/fuzzing.md)
	scripts/fuzz.sh

clean: ## Remove build output
	$(CARGO) clean

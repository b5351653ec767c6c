# rprof's set-up commands on a fresh Debian 12 machine, as root:
#   make demo     install what rprof needs, build it, profile demo/app.rb
#   make test     install what the tests need (Rubies included) and run them all
#   make release  dist/rprof (one stripped binary, glibc only) and dist/rprof_VERSION_amd64.deb
CARGO ?= cargo
APT_PACKAGES = clang llvm libelf-dev zlib1g-dev pkg-config make gcc ruby ruby-dev \
               debootstrap util-linux clang-format
# What only the tests use: real servers under load (and a Rails app: Debian's
# Rails 6.1 parts it needs); go tool pprof and a JSON schema validator, to
# read rprof's pprof and speedscope files as users' tools do.
TEST_PACKAGES = puma unicorn ruby-rack wrk libc6-dbg golang-go python3-jsonschema curl man-db tmux chromium openssl protobuf-compiler \
                ruby-railties ruby-actionpack ruby-actionview
RPROF = $(or $(CARGO_TARGET_DIR),target)/release/rprof

.PHONY: deps test-deps apt tracefs build demo test lint bench clean-cache release

deps:
	@$(MAKE) --no-print-directory apt PACKAGES="$(APT_PACKAGES)"

test-deps:
	@$(MAKE) --no-print-directory apt PACKAGES="$(TEST_PACKAGES)"
	@scripts/fetch-speedscope.sh

apt:
	@missing=$$(for p in $(PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "make: installing $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# Syscall tracepoints live in tracefs; mount it where the kernel expects it.
tracefs:
	@[ -d /sys/kernel/tracing/events ] || mount -t tracefs nodev /sys/kernel/tracing

build: deps
	$(CARGO) build --release --locked

# The build links libelf and zlib statically (.cargo/config.toml): the binary
# needs only glibc (2.34+) on a server.
VERSION = $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
release: build
	rm -rf dist && mkdir -p dist
	strip -o dist/rprof $(RPROF)
	scripts/make-deb.sh dist $(VERSION)

demo: build
	$(RPROF) record -F 499 -o rprof-demo.svg -- ruby demo/app.rb 5
	@echo "make: open $$(pwd)/rprof-demo.svg in a browser"

# The binary is built by the tests' build (scripts/run-tests.sh), beside the
# test harnesses; install.rs's `make release` finds it done: libc's features
# in Cargo.toml match the dev-dependencies', and build.rs leaves git's index
# alone (rewritten, it had the next build run build.rs again and rebuild).
test: deps test-deps tracefs lint
	scripts/setup-rubies.sh all
	CARGO=$(CARGO) scripts/run-tests.sh

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --release --locked --workspace --all-targets -- -D warnings
	clang-format --dry-run --Werror bpf/rprof.bpf.c bpf/rprof.h bpf/native.bpf.h bpf/threads.bpf.c

bench: build
	bench/overhead
	bench/syscall-storm
	bench/sample-cost
	bench/reader-cost
	bench/tick-share
	bench/cluster
	bench/forks
	bench/native
	bench/long-recording --minutes 10

clean-cache:
	rm -rf /var/cache/rprof

#!/usr/bin/env bash
# Runs every PolyGate test on a fresh machine: formatting and lints, the Rust tests
# (engine, the backend contract suite on memory / Redis / Redis Cluster, Redis fault
# tests, protocol vectors, server and binary tests), then the Python binding's tests
# (golden vectors, fake sidecar) and the end-to-end tests against the real daemon,
# then the Go binding (gofmt, go vet, go test -race: vectors, fake sidecar,
# conformance scenarios and end-to-end tests against the real daemon and Redis),
# then the Node.js binding (npm ci from its lockfile, tsc --strict, vectors, fake
# sidecar, conformance scenarios and end-to-end tests against the daemon and Redis),
# then the packages (scripts/package.sh; the wheel installed into a fresh venv and the
# npm tarballs into a fresh directory, each autostarting a sidecar for a gated call).
#
# It installs what it needs: redis-server (Debian package) if missing, and a Python
# venv in .venv with pytest, pytest-timeout, mypy and the `polygate` binding
# (editable). Tests start their own redis-server instances on free ports; with
# CI=true a Redis that cannot start fails the run instead of skipping.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

step() { printf '\n==> %s\n' "$*"; }

if ! command -v redis-server >/dev/null 2>&1; then
    step "installing redis-server (tests start their own instances)"
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
        echo "redis-server is missing and cannot be installed here (need root + apt-get)" >&2
        exit 1
    fi
fi

# CI builds once from a clean clone: incremental caches would only add ~1 GB to
# target/ (a CI run once failed with "No space left on device" while linking).
if [ "${CI:-}" = true ]; then
    export CARGO_INCREMENTAL=0
fi
# Only a warning: a df that fails or prints no number skips it.
free_kb=$(df -Pk "$root" 2>/dev/null | awk 'NR == 2 { print $4 }') || free_kb=
case $free_kb in
    '' | *[!0-9]*) ;;
    *)
        if [ "$free_kb" -lt 4000000 ]; then
            echo "warning: only $((free_kb / 1024)) MB free under $root; the Rust, Go and Node builds need about 3 GB" >&2
        fi
        ;;
esac

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "Rust tests"
cargo build --workspace --quiet
# The bench's smoke test runs last: its driver scenarios need every binding built.
cargo test --workspace --exclude polygate-bench

step "Python venv (.venv) with pytest, pytest-timeout, mypy, build, the SDKs (test-only) and the polygate binding"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# Test tools only: the binding itself has no runtime dependencies. httpx, httpx2,
# openai and anthropic are test-only: the HTTP transports (polygate.httpx /
# polygate.httpx2, DESIGN §17) are tested under the real SDKs; that `import polygate`
# works without any of them is tested too (test_transport_core.py blocks them in a
# subprocess).
# build + wheel (+ setuptools) let test_packaging.py build the wheel and sdist offline;
# pyyaml lets tests/test_deploy.py read the Kubernetes manifests.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pytest pytest-timeout mypy \
    build wheel "setuptools>=61" pyyaml httpx httpx2 openai anthropic
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e bindings/python

step "mypy --strict on the binding (it ships py.typed)"
.venv/bin/python -m mypy --strict --python-version 3.10 --no-incremental --cache-dir=/dev/null \
    bindings/python/polygate

step "Python tests (binding, vectors, end-to-end against the real daemon; 60 s timeout each)"
export POLYGATE_SIDECAR_BIN="$root/target/debug/polygate-sidecar"
# tests/test_install_packages.py needs the Node.js binding's dev dependencies: it runs
# as its own step after the Node.js one.
.venv/bin/python -m pytest -q bindings/python/tests tests --ignore=tests/test_install_packages.py

step "Go binding (gofmt, go vet, go test -race: vectors, fake sidecar, conformance, e2e)"
if ! command -v go >/dev/null 2>&1; then
    if [ "${CI:-}" = true ]; then
        echo "go is missing: the Go binding's tests (bindings/go) need Go 1.22+ (https://go.dev/dl); CI=true, so this fails the run" >&2
        exit 1
    fi
    echo "go is missing: the Go binding's tests (bindings/go) need Go 1.22+ (https://go.dev/dl); skipping them" >&2
else
    go_dirs="bindings/go examples/worker-go examples/transport-go bench/drivers/go_client"
    # shellcheck disable=SC2086
    unformatted=$(gofmt -l $go_dirs)
    if [ -n "$unformatted" ]; then
        printf 'gofmt: these files are not formatted (run gofmt -w):\n%s\n' "$unformatted" >&2
        exit 1
    fi
    go vet ./bindings/go/... ./examples/worker-go/... ./examples/transport-go/... ./bench/drivers/go_client/...
    (cd bindings/go && go test -race -count=1 -timeout 600s ./...)
fi

step "Node.js binding (npm ci, tsc --strict, vectors, fake sidecar, conformance + e2e on the real daemon)"
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1 \
    || ! node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 18 ? 0 : 1)'; then
    if [ "${CI:-}" = true ]; then
        echo "node/npm missing or older than Node.js 18: the Node.js binding's tests (bindings/node) need Node.js >= 18 with npm; CI=true, so this fails the run" >&2
        exit 1
    fi
    echo "node/npm missing or older than Node.js 18: the Node.js binding's tests (bindings/node) need Node.js >= 18 with npm; skipping them" >&2
else
    (
        cd bindings/node
        npm ci --no-audit --no-fund --loglevel=error
        npm run --silent build
        npm run --silent build:test
        timeout 900 node --test build/test/*.test.js
    )
fi

step "packages (scripts/package.sh: wheel + npm tarballs; installed outside the repo, autostart; ~25 s)"
if command -v node >/dev/null 2>&1 && [ -d bindings/node/node_modules ]; then
    .venv/bin/python -m pytest -q tests/test_install_packages.py
elif [ "${CI:-}" = true ]; then
    echo "the package test needs node/npm and bindings/node/node_modules; CI=true, so this fails the run" >&2
    exit 1
else
    echo "node/npm missing: skipping the package test (tests/test_install_packages.py)" >&2
fi

step "polygate-bench smoke test (every scenario prints its keys; tiny durations, no figures checked)"
cargo test -p polygate-bench

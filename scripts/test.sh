#!/usr/bin/env bash
# Full local/CI check for the fenced workspace: bring up the backing services
# (MariaDB, Redis, etcd, ZooKeeper; see scripts/services.sh), then format check, clippy,
# tests and docs. Any failing step stops the run (set -e).
set -euo pipefail

# Run from the repository root, wherever we were called from.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# rustup installs cargo into ~/.cargo/bin, which non-login shells (CI runners,
# sudo) often do not have on PATH.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi

# Escape codes only clutter CI logs.
if [ "${CI:-}" = true ]; then
    export CARGO_TERM_COLOR=never
fi

banner() {
    printf '\n==> %s\n' "$*"
}

banner "disk"
# A full target dir takes several GB; say how much room there is before a
# build fails half-way with "No space left on device".
df -h . | tail -n 1

banner "services (MariaDB, PostgreSQL, Redis, etcd, ZooKeeper)"
bash scripts/services.sh

banner "cargo fmt --check"
cargo fmt --all -- --check

banner "cargo clippy"
cargo clippy --workspace --all-targets -j 2 -- -D warnings
# The opt-in features: the facade's etcd and zookeeper, and the CLI's
# (fenced-cli, the `fenced` binary) etcd, zookeeper and bench. The
# workspace builds fenced-zookeeper with `tls` (faults enables the facade's
# zookeeper feature, which turns it on); its build without is checked here.
cargo clippy -p fenced --all-targets --features etcd,zookeeper -j 2 -- -D warnings
cargo clippy -p fenced-zookeeper --all-targets -j 2 -- -D warnings
cargo clippy -p fenced-cli --all-targets --features etcd,zookeeper,bench -j 2 -- -D warnings

banner "cargo test"
# The opt-in backends on: the facade and the CLI are tested against every
# backend.
cargo test --workspace --features fenced/etcd,fenced/zookeeper,fenced-cli/etcd,fenced-cli/zookeeper -j 2
# fenced-zookeeper without `tls` (zks:// must say which feature it needs).
cargo test -p fenced-zookeeper --lib -j 2

banner "cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps -j 2

banner "all checks passed"

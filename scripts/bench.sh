#!/usr/bin/env bash
# Run the full `fenced bench` matrix (every backend, etcd, ZooKeeper and
# PostgreSQL included, plus the peers) against the local services and write BENCHMARKS.md, the SVG plots and
# bench/results/results.jsonl from that one run, and the summary table in
# README.md. Takes about an hour on a 2-core machine (55 minutes on 2026-12-04:
# the many-keys cells hold 100 000 locks per store).
#
#   scripts/bench.sh            # full matrix
#   scripts/bench.sh --smoke    # the 10-second subset (does not touch BENCHMARKS.md)
#
# The hand-written analysis in bench/NOTES.md is appended to BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi

bash scripts/services.sh

# The `fenced` binary is the fenced-cli package; etcd (it needs protoc, which
# services.sh installs), zookeeper and postgres are opt-in features, bench
# adds the `fenced bench` command.
cargo build --release -p fenced-cli --features etcd,zookeeper,postgres,bench -j 2

if [ "${1:-}" = "--smoke" ]; then
    exec ./target/release/fenced bench --smoke --out "${TMPDIR:-/tmp}/fenced-bench-smoke"
fi

FENCED_LOG="${FENCED_LOG:-error}" ./target/release/fenced bench \
    --out bench/results --markdown BENCHMARKS.md --notes bench/NOTES.md --readme README.md

#!/usr/bin/env bash
# Run the fault-injection matrix (every store × fault, seeded runs, plus
# control runs with fencing off) against real servers and write
# RELIABILITY.md and faults/results/runs.jsonl.
#
#   scripts/faults.sh                      # full profile: 100 runs per cell
#   scripts/faults.sh --runs 3 --seed 42   # a quick look
#   scripts/faults.sh --only redis         # one store (or `kill`, one fault)
#   scripts/faults.sh --only process-,server-,leader,storm,mutant
#                                          # the client-process and server faults, mutant controls
#   scripts/faults.sh --resume --budget-min 90
#                                          # the full profile in sittings: keep the runs already in
#                                          # faults/results/runs.jsonl, run what is missing (seed by
#                                          # seed, every cell alike), start nothing after 90 minutes
#
# Needs, besides the services: the fenced-faults-client binary (built below
# with the runner), libfaketime's `faketime` for the clock-skew cell, and the
# mariadbd / redis-server / etcd binaries and Java with ZooKeeper's jar for
# the private servers — of the server faults, and the MariaDB with a binary
# log and the ZooKeeper whose transaction log give the MySQL and ZooKeeper
# cells their server truth — all installed by scripts/services.sh.
#
# The short profile (one run per cell) runs in CI as
# `cargo test -p fenced-faults --test short_profile`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi

bash scripts/services.sh
cargo build --release -p fenced-faults -j 2
FENCED_LOG="${FENCED_LOG:-error}" ./target/release/fenced-faults "$@"

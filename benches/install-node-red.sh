#!/bin/sh
# Installs Node-RED 4 for `cargo bench --bench compare` under the prefix given (the bench
# passes target/node-red). Needs node (v18+) and npm, and the npm registry.
set -eu
prefix=${1:-target/node-red}
command -v node >/dev/null || { echo "node is not installed (apt-get install nodejs npm)" >&2; exit 1; }
command -v npm >/dev/null || { echo "npm is not installed (apt-get install npm)" >&2; exit 1; }
mkdir -p "$prefix"
exec timeout 600 npm install --prefix "$prefix" --no-audit --no-fund node-red@4

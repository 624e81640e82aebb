#!/usr/bin/env bash
# Quick start, command 1: set everything up and replicate the embedded default end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pg2iceberg-dagster quickstart "$@"

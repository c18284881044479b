#!/usr/bin/env bash
# Lays out deepinfer's import names as links to a working tree, for a machine where the
# package is not installed (the GPU machine): kernels/ is deepinfer_kernels, scheduler/
# deepinfer_scheduler. Put the folder on PYTHONPATH and the tree runs as it is.
#
#   scripts/link_import_names.sh DIR [REPO]    # REPO defaults to this script's checkout
set -euo pipefail
DIR=${1:?usage: link_import_names.sh DIR [REPO]}
REPO=$(cd "${2:-$(dirname "$0")/..}" && pwd)
rm -rf "$DIR" && mkdir -p "$DIR"
ln -s "$REPO/deepinfer" "$DIR/deepinfer"
ln -s "$REPO/kernels" "$DIR/deepinfer_kernels"
ln -s "$REPO/scheduler" "$DIR/deepinfer_scheduler"

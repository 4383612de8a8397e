#!/usr/bin/env bash
# Installs ferry's build and test dependencies from Debian/Ubuntu packages, idempotently:
# packages already present are not touched, and apt-get runs only when something is missing.
set -euo pipefail

packages=(build-essential cmake pkg-config libfabric-dev libfabric-bin libgtest-dev
          libibverbs-dev libhwloc-dev python3-dev pybind11-dev python3-torch libtorch-dev
          python3-numpy clang libclang-rt-dev)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"

#!/usr/bin/env bash
# Installs every Debian package fdrollout needs to build, run and test (Debian 12).
# Idempotent; run as root (or with sudo available).
set -euo pipefail
pkgs=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl
  libboost-dev libcli11-dev libspdlog-dev libfmt-dev doctest-dev libcpp-httplib-dev
  nlohmann-json3-dev libsentencepiece-dev libopenblas-dev libssl-dev
  rsync python3 python3-numpy python3-jinja2 python3-prometheus-client
  libpcre2-dev libutf8proc-dev libgloo-dev libyaml-cpp-dev
  nginx-light  # tests/e2e/test_load_balancer.py: scripts/fleet_nginx.conf in front of a fleet on loopback
  haproxy      # tests/e2e/test_haproxy.py: scripts/fleet_haproxy.cfg in front of a fleet on loopback
  python3-torch  # a real PyTorch trainer/reference: bf16 forwards, trained MTP fixture, the GRPO example (~1 min)
)
# Node + npm run the reference tokenizers and template engine (tests/fixtures/fetch_npm_fixtures.sh);
# a machine that already has both (e.g. from NodeSource) keeps them.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then pkgs+=(nodejs npm); fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#pkgs[@]} packages present"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

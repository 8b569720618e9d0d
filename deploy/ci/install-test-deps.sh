#!/bin/sh
# Installs the system programs the deployment tests drive: nginx (gRPC load balancer) and
# prometheus (scrapes /metrics). Idempotent and quiet: does nothing when both are present.
# Debian/Ubuntu only (apt-get); needs root, or sudo without a password.
set -eu

missing=""
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$missing nginx"
command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || missing="$missing prometheus"
[ -z "$missing" ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: apt-get not found; install$missing yourself" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install-test-deps: need root to install$missing" >&2
        exit 1
    fi
fi

# The tests start their own nginx/prometheus with generated configs: keep the packages'
# system services from starting (and taking ports 80/9090) during installation.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    made_policy=1
fi
cleanup() { if [ "$made_policy" = 1 ]; then $SUDO rm -f "$policy"; fi; }
trap cleanup EXIT

echo "install-test-deps: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null

#!/usr/bin/env bash
# Install the headless browser the Flower browser test drives (tests/flower/test_browser.py):
# Debian's chromium and its chromedriver, at /usr/bin/chromium and /usr/bin/chromedriver.
# The Python side (selenium) comes from pip; Selenium is pointed at these two binaries, so its
# driver manager never downloads a browser or a driver.
#
# A no-op when both are installed. Needs root (CI runs as root) and Debian's package lists.
# Usage: bash scripts/browser.sh
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    echo "browser: chromium and chromedriver are installed"
    exit 0
fi
echo "browser: installing chromium and chromium-driver"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium chromium-driver >/dev/null
/usr/bin/chromium --version
/usr/bin/chromedriver --version

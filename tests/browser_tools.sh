#!/usr/bin/env bash
# What tests/test_browser_*.py need besides a ComfyUI tree, installed from the package registries
# where it is missing and can be: Debian's chromium (apt-get, as root) and playwright-core (npm, into
# <repo>/.browser-tools, git-ignored; no browser download).  One line per tool: found / installed /
# not installed and why.  Never fails: without them the browser tests skip and say why.
#   bash tests/browser_tools.sh
set -uo pipefail
root="$(cd "${0%/*}/.." && pwd)"
chromium=""
for c in "${CHROMIUM_PATH:-}" /usr/bin/chromium /usr/bin/chromium-browser; do
  [ -n "$c" ] && [ -x "$c" ] && { chromium=$c; break; }
done
if [ -n "$chromium" ]; then
  echo "browser tools: chromium found: $chromium"
elif ! command -v apt-get >/dev/null 2>&1; then
  echo "browser tools: chromium not installed: no apt-get here (install Debian's chromium or set CHROMIUM_PATH)"
elif [ "$(id -u)" != 0 ]; then
  echo "browser tools: chromium not installed: apt-get needs root (sudo apt-get install -y chromium)"
elif (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/tmp/browser_tools_apt.log 2>&1; then
  echo "browser tools: chromium installed with apt-get"
else
  echo "browser tools: chromium not installed: apt-get failed ($(tail -1 /tmp/browser_tools_apt.log))"
fi
pw=""
for d in "${PLAYWRIGHT_CORE_DIR:-}" /work/browser-tools/node_modules/playwright-core "$root/.browser-tools/node_modules/playwright-core"; do
  [ -n "$d" ] && [ -f "$d/package.json" ] && { pw=$d; break; }
done
if [ -z "$pw" ] && command -v npm >/dev/null 2>&1; then
  g="$(npm root -g 2>/dev/null)/playwright-core"
  [ -f "$g/package.json" ] && pw=$g
fi
if [ -n "$pw" ]; then
  echo "browser tools: playwright-core found: $pw"
elif ! command -v npm >/dev/null 2>&1; then
  echo "browser tools: playwright-core not installed: no npm here (apt-get install -y nodejs npm)"
elif (mkdir -p "$root/.browser-tools" && cd "$root/.browser-tools" && npm install --no-audit --no-fund --silent playwright-core) >/tmp/browser_tools_npm.log 2>&1; then
  echo "browser tools: playwright-core installed in $root/.browser-tools"
else
  echo "browser tools: playwright-core not installed: npm failed ($(tail -1 /tmp/browser_tools_npm.log))"
fi
exit 0

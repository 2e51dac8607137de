#!/usr/bin/env bash
# Refreshes the dashboard's vendored JavaScript (static/vendor/) from the npm registry.
#
# The versions are pinned here and nowhere else; the dashboard fetches nothing at run time. Each
# package's licence file is kept beside its code, and VERSIONS records what was vendored and the
# sha256 of every file. Run it after changing a pin: `make vendor-static`.
set -euo pipefail
cd "$(dirname "$0")/.."

# htmx stays on 2.x: htmx 4 changed its SSE and polling semantics.
HTMX_VERSION="2.0.11"
UPLOT_VERSION="1.6.32"

DEST="static/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

fetch() {  # fetch <package> <version>: unpacks the registry tarball into $work/<package>/package
  local package="$1" version="$2"
  mkdir -p "$work/$package"
  (cd "$work/$package" && npm pack --silent "$package@$version" >/dev/null && tar -xzf ./*.tgz)
}

fetch htmx.org "$HTMX_VERSION"
fetch uplot "$UPLOT_VERSION"

rm -rf "$DEST/htmx" "$DEST/uplot"
mkdir -p "$DEST/htmx" "$DEST/uplot"
cp "$work/htmx.org/package/dist/htmx.min.js" "$DEST/htmx/"
cp "$work/htmx.org/package/LICENSE" "$DEST/htmx/LICENSE"
cp "$work/uplot/package/dist/uPlot.iife.min.js" "$DEST/uplot/"
cp "$work/uplot/package/dist/uPlot.min.css" "$DEST/uplot/"
cp "$work/uplot/package/LICENSE" "$DEST/uplot/LICENSE"

{
  echo "# Vendored by scripts/vendor_static.sh from the npm registry; do not edit by hand."
  echo "htmx.org@$HTMX_VERSION"
  echo "uplot@$UPLOT_VERSION"
  echo
  (cd "$DEST" && find htmx uplot -type f | sort | xargs sha256sum)
} > "$DEST/VERSIONS"
echo "vendored htmx.org@$HTMX_VERSION and uplot@$UPLOT_VERSION into $DEST"

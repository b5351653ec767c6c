#!/bin/sh
# speedscope, from its npm package (pinned, checked), into
# /var/cache/rprof/speedscope: its file-format JSON schema, which tests
# validate rprof's speedscope output against, and the app itself
# (dist/release), which tests open rprof's files in with headless Chromium.
set -eu
VERSION=1.25.0
TARBALL_SHA256=2831f1e0d26df914b477e522d78b8485511495a6af81a0b88158f8b48f9e0d03
DIR=/var/cache/rprof/speedscope
SCHEMA=$DIR/file-format-schema.json
APP=$DIR/app

if [ -f "$SCHEMA" ] && [ -f "$APP/index.html" ] && [ "$(cat "$DIR/version" 2>/dev/null)" = "$VERSION" ]; then
    exit 0
fi
echo "fetch-speedscope: speedscope $VERSION from the npm registry"
mkdir -p "$DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl -fsSL "https://registry.npmjs.org/speedscope/-/speedscope-$VERSION.tgz" -o "$tmp/speedscope.tgz"
if ! echo "$TARBALL_SHA256  $tmp/speedscope.tgz" | sha256sum -c --status; then
    echo "fetch-speedscope: the package's checksum is not $TARBALL_SHA256" >&2
    exit 1
fi
tar -xzf "$tmp/speedscope.tgz" -C "$tmp" package/dist/release
rm -rf "$APP"
cp "$tmp/package/dist/release/file-format-schema.json" "$SCHEMA"
mv "$tmp/package/dist/release" "$APP"
echo "$VERSION" > "$DIR/version"

#!/bin/sh
# speedscope's file-format JSON schema, which tests validate rprof's
# speedscope output against: fetched once from the npm package it ships in
# (pinned, checked) into /var/cache/rprof/speedscope.
set -eu
VERSION=1.25.0
SHA256=03d098921294fca54ac1b67ea050138d867e44228c7cb140d958fbdfe345c911
DIR=/var/cache/rprof/speedscope
SCHEMA=$DIR/file-format-schema.json

if [ -f "$SCHEMA" ] && echo "$SHA256  $SCHEMA" | sha256sum -c --status; then
    exit 0
fi
echo "fetch-speedscope-schema: speedscope $VERSION from the npm registry"
mkdir -p "$DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl -fsSL "https://registry.npmjs.org/speedscope/-/speedscope-$VERSION.tgz" -o "$tmp/speedscope.tgz"
tar -xzf "$tmp/speedscope.tgz" -C "$tmp" package/dist/release/file-format-schema.json
if ! echo "$SHA256  $tmp/package/dist/release/file-format-schema.json" | sha256sum -c --status; then
    echo "fetch-speedscope-schema: the schema's checksum is not $SHA256" >&2
    exit 1
fi
mv "$tmp/package/dist/release/file-format-schema.json" "$SCHEMA"

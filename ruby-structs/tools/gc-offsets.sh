#!/bin/sh
# Prints the [gc] section of a layout file: what rprof needs of `rb_objspace`
# (defined in gc.c, not in any header, so layout-probe.c cannot see it).
# Compiles gc.o with debug info in a configured Ruby source tree and reads the
# struct with pahole (Debian package dwarves).
#   ruby-structs/tools/gc-offsets.sh /path/to/ruby-3.4.5 >> ruby-structs/layouts/3.4.toml
set -eu
src=${1:?usage: gc-offsets.sh CONFIGURED_RUBY_SOURCE_DIR}
command -v pahole >/dev/null || { echo "gc-offsets: needs pahole (apt-get install dwarves)" >&2; exit 1; }
make -C "$src" gc.o >/dev/null
off() { # a field's offset in rb_objspace, from pahole's "/* offset size */" comment
    pahole -C rb_objspace "$src/gc.o" | awk -v f="$1" '
        $0 ~ "[ \t]" f ";" { for (i = 1; i <= NF; i++) if ($i == "/*") { print $(i + 1); exit } }'
}
count=$(off count)
major=$(off major_gc_count)
minor=$(off minor_gc_count)
[ -n "$count" ] && [ -n "$major" ] && [ -n "$minor" ] || { echo "gc-offsets: profile.count, major_gc_count or minor_gc_count not found" >&2; exit 1; }
echo "# From tools/gc-offsets.sh."
echo "[gc]"
echo "major_gc_count_from_count = $((major - count))"
echo "minor_gc_count_from_count = $((minor - count))"
# GC.stat(:time)'s fields: total_time_ns (3.1, 3.2), or marking_time_ns and
# sweeping_time_ns (3.3 on); none before 3.1.
times=""
for f in total_time_ns marking_time_ns sweeping_time_ns; do
    at=$(off "$f")
    if [ -n "$at" ]; then times="${times:+$times, }$((at - count))"; fi
done
if [ -n "$times" ]; then echo "time_ns_from_count = [$times]"; fi

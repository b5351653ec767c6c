# Builds rprof_native.so for the --native tests, optimised and without frame
# pointers (the flags come last, so they win over Ruby's own).
require "mkmf"
$CFLAGS << " -O2 -fomit-frame-pointer"
create_makefile("rprof_native")

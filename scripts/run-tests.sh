#!/bin/bash
# Runs every test binary, even after one fails, and ends with one line per
# suite and the name of each failed test, so that a failure in one suite
# neither hides the others' results nor scrolls away.
#
# The suites run in two lanes at once (the machine has two CPUs, and most
# tests wait on recordings), each suite's tests one at a time: every test
# then runs beside another suite's, on a busy machine, which is where
# rprof's bounds must hold anyway. The suites that look at every process on
# the host (`agent`, and `--all` in `processes`) would see the other lane's
# Rubies: they run after the lanes, alone (SUITE:FILTER for the tests of a
# suite whose names contain FILTER, which its lane skips). So do the tests
# whose premise is a load they make themselves, which another suite's load
# changes as its tests start and stop: servers.rs (wrk saturates both
# CPUs); gc.rs, whose burst of collections must end in 10 s (ci54: it did
# not, for all three Rubies, beside the other lane); the code churn tests
# (frames.rs, on every Ruby: the last run saturates both CPUs itself, and
# the [unknown] share follows how soon rprof reads; recordings.rs: what a
# bounded recording holds follows the target's churn rate, which follows
# the CPU it gets; ci53, two lanes and a CPU-burning loop, failed both);
# wall.rs's storm of short waits, pinned to CPU 0, whose sampled split
# between two methods is held to 5 points of the program's clock: another
# suite's programs on that CPU make a few of its waits long and the split's
# error grows (ci66: 5.7 points beside frames.rs; README, "Storms of short
# waits").
# The host-wide suites need no idle CPU, only no other Ruby: the suites
# that start no Ruby (the unit tests, whose reader fuzzing takes 35 s) run
# beside them, in their own lane. Not the doc tests: they start cargo and
# rustdoc, which the agent looks at as they exec, and its memory while its
# server is down grew by 20 MB (ci138; 19.9 MB by hand, RssAnon, the file
# pages flat).
# The lanes are balanced by the suites' times in CI beside each other
# (ci55: 670 and 690 s; frames.rs 510 s, wall.rs 330; ci124: 434 and 449 s,
# so wall.rs's Unix socket and file tests, 10 s, moved to lane A as
# SUITE:FILTER; ci137, with cpu.rs in lane A: 486 and 468 s, then 36 s less
# of layouts.rs in A, so two more wall.rs tests, 11 s, moved to A); a suite
# not named runs in lane B.
set -uo pipefail
cargo=${CARGO:-cargo}
lane_a="frames install layouts diff syscall browser top launch errors cpu
        wall:unix_socket wall:file_device_and_pipe
        wall:a_slow_detach_adds_nothing wall:speedscope_thread_in_time_order"
host_wide="agent processes:every_ruby_on_the_host_now_and_as_they_start"
rubyless="flamegraphs ruby_structs rbspy_structs rprof"
alone="gc servers frames:code_churn_never_mislabels recordings:memory_stays_flat_under_code_churn
       wall:short_waits"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# The plan: each suite's tests per lane, as "lane<TAB>suite<TAB>heading<TAB>
# package dir<TAB>executable<TAB>file of the tests' exact names". A suite is
# a unit-test binary, or a module of the integration tests' one binary
# (tests/suites.rs: frames.rs is the module `frames`); SUITE:FILTER is the
# suite's tests whose names contain FILTER.
"$cargo" test --release --locked --workspace --no-run --message-format=json 2>"$logs/build" >"$logs/json"
status=$?
if [ "$status" -ne 0 ]; then
    cat "$logs/build"
    exit "$status"
fi
# In name order: cargo lists binaries as their builds end, which differs from
# one machine to the next, and with it which suites run beside each other
# (the official CI's frames.rs met processes.rs's CPU-bound Rubies, this
# machine's did not); every machine now runs the same pairs.
LANE_A=$lane_a HOST_WIDE=$host_wide RUBYLESS=$rubyless ALONE=$alone \
python3 - "$logs/json" "$logs" >"$logs/plan" <<'EOF' || exit 1
import json, os, subprocess, sys
lanes = {lane: os.environ[var].split() for lane, var in
         [("a", "LANE_A"), ("host_wide", "HOST_WIDE"), ("rubyless", "RUBYLESS"), ("alone", "ALONE")]}
suites = {}
integration = None  # (package dir, executable) of tests/suites.rs
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m.get("profile", {}).get("test"):
        continue
    t, exe = m["target"], m["executable"]
    if t["kind"][0] == "test" and t["name"] == "suites":
        integration = (os.path.dirname(m["manifest_path"]), exe)
    listed = subprocess.run([exe, "--list", "--format", "terse"], capture_output=True, text=True, check=True)
    names = [l[: -len(": test")] for l in listed.stdout.splitlines() if l.endswith(": test")]
    for name in names:
        if t["kind"][0] == "test" and t["name"] == "suites":
            suite, short = name.split("::", 1)
            heading = f"Running tests/{suite}.rs ({exe})"
        elif t["kind"][0] == "test":
            suite, short = t["name"], name
            heading = f"Running tests/{os.path.basename(t['src_path'])} ({exe})"
        else:
            suite, short = t["name"], name
            heading = f"Running unittests {os.path.basename(t['src_path'])} ({exe})"
        key = (suite, heading, os.path.dirname(m["manifest_path"]), exe)
        suites.setdefault(key, []).append((short, name))

# With `autotests = false`, a tests/NAME.rs that tests/suites.rs does not
# name as a module would never run: that ends the run.
if integration:
    in_binary = {k[0] for k in suites if k[3] == integration[1]}
    for f in sorted(os.listdir(os.path.join(integration[0], "tests"))):
        if f.endswith(".rs") and f != "suites.rs" and f[:-3] not in in_binary:
            sys.exit(f"tests/{f} is not a module of tests/suites.rs: add `mod {f[:-3]};` there")

def lane_of(suite, short):
    # SUITE:FILTER entries first: they take tests from a suite placed whole.
    for lane, entries in lanes.items():
        if any(e.startswith(suite + ":") and e.split(":", 1)[1] in short for e in entries):
            return lane
    for lane, entries in lanes.items():
        if suite in entries:
            return lane
    return "b"

rows = []
for n, (key, tests) in enumerate(sorted(suites.items())):
    by_lane = {}
    for short, name in tests:
        by_lane.setdefault(lane_of(key[0], short), []).append(name)
    for lane, names in sorted(by_lane.items()):
        path = os.path.join(sys.argv[2], f"tests-{n}-{lane}")
        with open(path, "w") as f:
            f.write("\n".join(names) + "\n")
        rows.append([lane, *key, path])
# A lane's suites in name order, but the Ruby-less ones in the order given:
# every binary exec'd at once but the last, so that none starts while an
# agent test holds the agent's memory to what it was.
rubyless_order = lambda row: lanes["rubyless"].index(row[1]) if row[0] == "rubyless" else 0
for row in sorted(rows, key=rubyless_order):
    print("\t".join(row))
EOF

# Runs the suites of lane $1 (a, b, host_wide, rubyless or alone) in order,
# each as cargo would (from its package's directory, under cargo's heading,
# so that the summary below reads both alike); the log holds their output,
# the status file a line per failed suite.
run_lane() {
    local lane=$1 want suite heading dir exe tests
    while IFS=$'\t' read -r want suite heading dir exe tests; do
        [ "$want" = "$lane" ] || continue
        echo "     $heading"
        mapfile -t names <"$tests"
        (cd "$dir" && "$exe" --test-threads=1 --exact "${names[@]}") 2>&1 || echo "$suite" >>"$logs/failed"
    done <"$logs/plan"
}

phase() { printf '%s %d s; ' "$1" $((SECONDS - phase_began)) >>"$logs/phases"; phase_began=$SECONDS; }
phase_began=$SECONDS
run_lane a >"$logs/a" &
lane_a_pid=$!
run_lane b >"$logs/b" &
lane_b_pid=$!
wait "$lane_a_pid" "$lane_b_pid"
phase "lanes a and b"
run_lane host_wide >"$logs/host_wide" &
host_wide_pid=$!
run_lane rubyless >"$logs/rubyless"
wait "$host_wide_pid"
phase "host-wide beside Ruby-less"
"$cargo" test --release --locked --workspace --doc >"$logs/doc" 2>&1 || echo doc-tests >>"$logs/failed"
run_lane alone >"$logs/alone"
phase "doc tests and alone"
cat "$logs/a" "$logs/b" "$logs/host_wide" "$logs/rubyless" "$logs/doc" "$logs/alone"

echo
echo "make test: one line per suite"
awk '
    /^ *Running /  {
        suite = $2; sub(/^.*\//, "", suite)
        # "Running unittests src/lib.rs (target/release/deps/NAME-HASH)"
        if (suite == "unittests") { suite = $4; sub(/^.*\//, "", suite); sub(/-[0-9a-f]+\)$/, "", suite); suite = "unit tests " suite }
    }
    /^ *Doc-tests / { suite = "doc-tests " $2 }
    /^test .* \.\.\. FAILED$/ { failed[suite] = failed[suite] "\n    failed: " $2 }
    /^test result:/ {
        sub(/^test result: /, "")
        # Each suite runs its tests by name: what it filtered out is other suites.
        sub(/; 0 measured; [0-9]+ filtered out/, "")
        printf "  %-28s %s%s\n", suite, $0, failed[suite]
    }
' "$logs/a" "$logs/b" "$logs/host_wide" "$logs/rubyless" "$logs/doc" "$logs/alone"
echo "phases: $(cat "$logs/phases")"
if [ -s "$logs/failed" ]; then
    echo "failed suites: $(tr '\n' ' ' <"$logs/failed")"
    exit 1
fi

# A Ruby thread burning CPU at a fixed stack depth, for bench/sample-cost:
# waits for "go" on stdin, spins for SECONDS at DEPTH frames (<main>, the
# recursion, the spinning method), prints "spun SECONDS" and exits.
# With "alloc" as a third argument it allocates as it spins, so minor GCs run
# every few milliseconds and nearly every sample is a new record for rprof
# (a record per stack and GC time): the cost of a sample that is sent.
DEPTH = Integer(ARGV.fetch(0, "30"))
SECONDS = Float(ARGV.fetch(1, "3"))
ALLOC = ARGV[2] == "alloc"

def descend(depth)
  depth <= 2 ? spin : descend(depth - 1)
end

def spin
  stop = Process.clock_gettime(Process::CLOCK_MONOTONIC) + SECONDS
  x = 0
  if ALLOC
    x += Object.new.hash & 1 while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop
  else
    x += 1 while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop
  end
  x
end

$stdout.puts "ready"
$stdout.flush
$stdin.gets
t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
descend(DEPTH)
$stdout.puts "spun #{Process.clock_gettime(Process::CLOCK_MONOTONIC) - t}"
$stdout.flush

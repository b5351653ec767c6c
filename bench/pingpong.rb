# The context-switch storm for bench/switch-storm: two threads bounce a byte
# through two pipes N times (each round trip blocks and wakes each thread
# once). WORK loop iterations per round trip in the main thread slow it down.
# Waits for "go" on stdin, prints "made N elapsed SECONDS" and exits.
N = Integer(ARGV.fetch(0, "200000"))
WORK = Integer(ARGV.fetch(1, "0"))

a_r, a_w = IO.pipe
b_r, b_w = IO.pipe
$stdout.puts "ready"
$stdout.flush
$stdin.gets
t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
echo = Thread.new { N.times { b_w.syswrite(a_r.sysread(1)) } }
N.times do
  a_w.syswrite("x")
  b_r.sysread(1)
  i = 0
  i += 1 while i < WORK
end
echo.join
$stdout.puts "made #{N} elapsed #{Process.clock_gettime(Process::CLOCK_MONOTONIC) - t}"
$stdout.flush

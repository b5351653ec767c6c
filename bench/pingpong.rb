# The context-switch storm for bench/switch-storm: two threads bounce a byte
# through two pipes N times (each round trip blocks and wakes each thread
# once). WORK loop iterations per round trip in the main thread slow it down.
# Waits for "go" on stdin, prints "made N elapsed SECONDS switches S" (S: the
# two threads' context switches in the storm, each read by the thread itself
# before it ends: a thread that has ended is gone from /proc/PID/task), then
# waits for a line on stdin before it exits, so that the bench can read the
# profiler's BPF statistics while the profiler is still attached.
N = Integer(ARGV.fetch(0, "200000"))
WORK = Integer(ARGV.fetch(1, "0"))

def switches
  File.foreach("/proc/thread-self/status").sum do |line|
    line.include?("ctxt_switches:") ? Integer(line.split.last) : 0
  end
end

a_r, a_w = IO.pipe
b_r, b_w = IO.pipe
$stdout.puts "ready"
$stdout.flush
$stdin.gets
start = Queue.new
echo = Thread.new do
  before = switches
  start << true
  N.times { b_w.syswrite(a_r.sysread(1)) }
  switches - before
end
start.pop
before = switches
t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
N.times do
  a_w.syswrite("x")
  b_r.sysread(1)
  i = 0
  i += 1 while i < WORK
end
elapsed = Process.clock_gettime(Process::CLOCK_MONOTONIC) - t
made = switches - before + echo.value
$stdout.puts "made #{N} elapsed #{elapsed} switches #{made}"
$stdout.flush
$stdin.gets

# Thread "looper" loops x -> y -> z reading the process's CPU clock
# (clock_gettime(CLOCK_PROCESS_CPUTIME_ID): a system call, unlike the
# monotonic clock, and it allocates nothing, so no GC of its own; getpid is
# cached from Ruby 3.3). Once SIGUSR1 comes, the main thread runs a minor
# GC, lets the looper run in that GC's time, runs a major GC, lets it run
# again, and prints "gcs" with the counts GC.stat gave after each.
def z
  Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID, :nanosecond)
end

def y
  z
end

def x
  y
end

started = Queue.new
Thread.new do
  Thread.current.name = "looper"
  started << true
  loop { x }
end
started.pop
# Everything so far old (promoted): only a major GC may free it.
4.times { GC.start }
go_r, go_w = IO.pipe
trap("USR1") { go_w.syswrite("g") }
$stdout.puts "ready"
$stdout.flush
go_r.read(1)
GC.start(full_mark: false)
minor = [GC.stat(:count), GC.stat(:major_gc_count)]
sleep 0.3
GC.start
major = [GC.stat(:count), GC.stat(:major_gc_count)]
sleep 0.3
$stdout.puts "gcs minor=#{minor.join(",")} major=#{major.join(",")}"
$stdout.flush
sleep

# One thread that spends its time in garbage collections of two kinds, for
# rprof's GC frames: `collect` starts a major one (GC.start(full_mark: true),
# marking then sweeping at once) over a heap kept alive, and `churn`
# allocates short-lived strings, which starts minor ones. After each call it
# prints its counters (every few ms, so that a window's ends are exact): CPU
# time, GC.stat's time (Ruby 3.1+, else -1) and counts, and how many majors it
# started itself. Runs until killed.
KEEP = Array.new(300_000) { |i| "kept #{i}" }

def collect
  GC.start(full_mark: true, immediate_sweep: true)
end

def churn
  i = 0
  while i < 200_000
    "short-lived #{i}"
    i += 1
  end
end

def stats(started)
  cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID, :millisecond)
  s = GC.stat
  "stats cpu_ms=#{cpu} gc_ms=#{s.fetch(:time, -1)} major=#{s[:major_gc_count]} " \
    "minor=#{s[:minor_gc_count]} started=#{started}"
end

started = 0
$stdout.puts "ready main=#{Thread.main.respond_to?(:native_thread_id) ? Thread.main.native_thread_id : '?'}"
$stdout.flush
report = lambda do
  $stdout.puts stats(started)
  $stdout.flush
end
loop do
  collect
  started += 1
  report.call
  5.times do
    churn
    report.call
  end
end

# `wall`'s GVL waits still open when a recording stops. `spinner` only
# counts, allocating nothing. On SIGUSR1 the main thread, at thread priority
# 3 (time slices of 800 ms to the spinner's 100 ms), allocates short-lived
# strings for good, so that minor collections run all through its slices,
# while the spinner waits for the GVL. 400 ms into each slice of its own it
# prints how long the GC has run since SIGUSR1 (ms, by GC.stat's clock; -1
# on Ruby 2.7, which keeps none): all of it while the spinner waited, for
# the spinner never allocates. The test stops rprof there, in the middle of
# one of the spinner's waits.
KEEP = Array.new(200_000) { |i| "kept #{i}" }

def spin
  x = 0
  loop { x += 1 }
end

def churn
  200.times { |i| "young #{i}" }
end

def gc_ms
  GC.stat.key?(:time) ? GC.stat(:time) : -1
end

def now
  Process.clock_gettime(Process::CLOCK_MONOTONIC)
end

go = false
trap("USR1") { go = true }
started = Queue.new
spinner = Thread.new do
  started << (Thread.current.respond_to?(:native_thread_id) ? Thread.current.native_thread_id : "?")
  spin
end
spinner.name = "spinner"
$stdout.puts "ready spinner=#{started.pop}"
$stdout.flush
sleep 0.01 until go
Thread.current.priority = 3
gc_at = gc_ms
slice_at = last = now
told = false
loop do
  t = now
  # A pause this long is the spinner's time slice: one of ours begins.
  if t - last > 0.02
    slice_at = t
    told = false
  end
  last = t
  if !told && t - slice_at > 0.4
    # Not `puts`: a blocking write releases the GVL, and ends the slice.
    $stdout.write_nonblock("deep gc_ms=#{gc_at < 0 ? -1 : gc_ms - gc_at}\n")
    told = true
  end
  churn
end

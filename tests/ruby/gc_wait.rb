# Two threads for `wall`'s waits on another thread's GC. `spinner` only
# counts, allocating nothing, so it waits for the GVL whenever the main
# thread holds it. On SIGUSR1 the main thread makes a burst of minor
# collections, each over 50,000 new strings (`collect`: the spinner waits
# through each one), prints how long they took by GC.stat's clock (ms; -1 on
# Ruby 2.7, which keeps none) and how many were major, and sleeps for good.
# Nothing collects before or after the burst, so the recording's window need
# not be known to the ms.
# (Minor, so that the spinner's frames, old objects, stay nameable: rprof
# cannot vouch for an address across a major collection it did not read
# before, and names such a frame [unknown]. So the strings are garbage once
# `collect` returns: kept in a constant's array, as they were, enough of
# them grew old to make one collection in five major, for want of free
# slots.)
KEEP = Array.new(200_000) { |i| "kept #{i}" }

def spin
  x = 0
  loop { x += 1 }
end

def collect
  young = Array.new(50_000) { |i| "young #{i}" }
  GC.start(full_mark: false, immediate_sweep: true)
  young.size
end

# The burst's GC time and its longest collection, in ms by GC.stat (-1, -1
# without a clock).
def burst(n)
  unless GC.stat.key?(:time)
    n.times { collect }
    return [-1, -1]
  end

  longest = 0
  total = 0
  n.times do
    before = GC.stat(:time)
    collect
    took = GC.stat(:time) - before
    total += took
    longest = took if took > longest
  end
  [total, longest]
end

go = false
trap("USR1") { go = true }
# The heap grows to what `collect` needs before the burst: a collection
# that finds too few free slots is major (Ruby 3.3's first one did).
3.times { collect }
started = Queue.new
spinner = Thread.new do
  # Its native thread id is known once it runs.
  started << (Thread.current.respond_to?(:native_thread_id) ? Thread.current.native_thread_id : "?")
  spin
end
spinner.name = "spinner"
$stdout.puts "ready spinner=#{started.pop}"
$stdout.flush
sleep 0.01 until go
t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
majors = GC.stat(:major_gc_count)
ms, longest = burst(100)
majors = GC.stat(:major_gc_count) - majors
took = Process.clock_gettime(Process::CLOCK_MONOTONIC) - t
$stdout.puts "burst gc_ms=#{ms} longest_ms=#{longest} majors=#{majors} seconds=#{took.round(3)}"
$stdout.flush
sleep

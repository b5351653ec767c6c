# A storm of short waits, for `rprof record ... wall`'s sampling: two threads
# bounce a byte through two pipes as fast as they can. The pinger waits for
# the echo in `wait_a` three times for each time in `wait_b`, and the echo
# spins about 100 us before it answers wait_b's byte: wait_b's waits are
# fewer but longer. The pinger times each call and its totals are printed
# ten times a second ("times a=NS b=NS"), the truth rprof's shares are held
# to. Says
# ready after the first thousand round trips; runs until killed.
CLOCK = Process::CLOCK_MONOTONIC

def spin_for(ns)
  until_t = Process.clock_gettime(CLOCK, :nanosecond) + ns
  nil while Process.clock_gettime(CLOCK, :nanosecond) < until_t
end

def wait_a(w, r)
  w.syswrite("a")
  r.sysread(1)
end

def wait_b(w, r)
  w.syswrite("b")
  r.sysread(1)
end

a_r, a_w = IO.pipe
b_r, b_w = IO.pipe
started = Queue.new
times = { a: 0, b: 0 }
echo = Thread.new do
  Thread.current.name = "echo"
  loop do
    c = a_r.sysread(1)
    spin_for(100_000) if c == "b"
    b_w.syswrite(c)
  end
end
timed = lambda do |key, &call|
  t = Process.clock_gettime(CLOCK, :nanosecond)
  call.call
  times[key] += Process.clock_gettime(CLOCK, :nanosecond) - t
end
pinger = Thread.new do
  Thread.current.name = "pinger"
  trips = 0
  loop do
    3.times { timed.call(:a) { wait_a(a_w, b_r) } }
    timed.call(:b) { wait_b(a_w, b_r) }
    trips += 4
    started << 1 if trips == 1000
  end
end
started.pop
tid = ->(t) { t.respond_to?(:native_thread_id) ? t.native_thread_id : "?" }
$stdout.puts "ready pinger=#{tid[pinger]} echo=#{tid[echo]}"
$stdout.flush
loop do
  sleep 0.1
  $stdout.puts "times a=#{times[:a]} b=#{times[:b]}"
  $stdout.flush
end

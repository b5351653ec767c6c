# A thread that runs about 5 ms in `work`, then sleeps 1 ms in `rest`, over
# and over, for `rprof record ... wall`: its time on CPU is in `work`, though
# it always leaves the CPU in `rest`. Says ready once it has started; runs
# until killed.
def work
  clock = -> { Process.clock_gettime(Process::CLOCK_MONOTONIC) }
  until_t = clock.call + 0.005
  x = 0
  x += 1 while clock.call < until_t
end

def rest
  sleep 0.001
end

started = Queue.new
worker = Thread.new do
  started << 1
  loop do
    work
    rest
  end
end
started.pop
$stdout.puts "ready worker=#{worker.respond_to?(:native_thread_id) ? worker.native_thread_id : '?'}"
$stdout.flush
worker.join

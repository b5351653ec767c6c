# A thread that sleeps 1.5 s in `first`, then 1.5 s in `second`, over and over,
# for `rprof record ... wall` in time order. Says ready once it has started;
# runs until killed.
def first
  sleep 1.5
end

def second
  sleep 1.5
end

started = Queue.new
worker = Thread.new do
  started << 1
  loop do
    first
    second
  end
end
started.pop
$stdout.puts "ready worker=#{worker.respond_to?(:native_thread_id) ? worker.native_thread_id : '?'}"
$stdout.flush
worker.join

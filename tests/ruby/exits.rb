# A program that ends during the recording, for `rprof record ... wall`: a
# thread spinning, the main thread asleep; 2 s after ready, it exits. Every
# one of its threads ends then, and must not count its life again.
started = Queue.new
spinner = Thread.new do
  started << 1
  x = 0
  loop { x += 1 }
end
started.pop
$stdout.puts "ready spinner=#{spinner.respond_to?(:native_thread_id) ? spinner.native_thread_id : '?'}"
$stdout.flush
sleep 2
exit!(0)

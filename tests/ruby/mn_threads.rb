# More Ruby threads than native threads: run with RUBY_MN_THREADS=1 and
# RUBY_MAX_CPU=2 (Ruby 3.3+), eight named threads, each burning CPU in its
# own method, take turns on two shared native threads.
THREADS = 8

THREADS.times do |i|
  Object.class_eval(<<~RUBY, __FILE__, __LINE__ + 1)
    def mn_work_#{i}
      x = 0
      loop { x += 1 }
    end
  RUBY
end

threads = THREADS.times.map do |i|
  Thread.new do
    Thread.current.name = "w#{i}"
    send(:"mn_work_#{i}")
  end
end
sleep 0.2 until threads.all? { |t| t.name }
$stdout.puts "ready ruby_threads=#{Thread.list.size}"
$stdout.flush
threads.each(&:join)

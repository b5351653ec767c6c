# For bench/wall-threads: ARGV[0] threads (default 1000), all but ten asleep
# for good in Object#idle; the ten wake every 5 ms and do a little work. Says
# "ready" once all are started; runs until killed.
def idle
  sleep
end

def tick
  loop do
    sleep 0.005
    x = 0
    2000.times { x += 1 }
  end
end

n = Integer(ARGV.fetch(0, "1000"))
threads = Array.new(n - 10) { Thread.new { idle } }
threads += Array.new(10) { Thread.new { tick } }
sleep 0.01 until threads.first(n - 10).all? { |t| t.status == "sleep" }
$stdout.puts "ready threads=#{n}"
$stdout.flush
threads.each(&:join)

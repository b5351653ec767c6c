# ARGV[0] threads (default 1000), each asleep in Object#idle; the main
# thread joins them. Says "ready" once all are parked.
def idle
  sleep
end

n = Integer(ARGV.fetch(0, "1000"))
threads = Array.new(n) { Thread.new { idle } }
sleep 0.01 until threads.all? { |t| t.status == "sleep" }
$stdout.puts "ready threads=#{n}"
$stdout.flush
threads.each(&:join)

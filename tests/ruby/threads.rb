# Two threads on CPU at once: alpha runs Ruby code holding the GVL, beta
# compresses with zlib, which releases the GVL. A profiler that reads the GVL
# holder's stack would put beta's CPU time under alpha's methods.
require "zlib"

def alpha_work
  x = 0
  200_000.times { |i| x += i }
  x
end

def alpha_loop
  loop { alpha_work }
end

def beta_work(data)
  Zlib::Deflate.deflate(data, Zlib::BEST_COMPRESSION)
end

def beta_loop
  data = Random.new(1).bytes(1 << 20) * 4
  loop { beta_work(data) }
end

alpha = Thread.new { Thread.current.name = "alpha"; alpha_loop }
beta = Thread.new { Thread.current.name = "beta"; beta_loop }
sleep 0.1 until alpha.native_thread_id && beta.native_thread_id
$stdout.puts "ready alpha=#{alpha.native_thread_id} beta=#{beta.native_thread_id} main=#{Thread.main.native_thread_id}"
$stdout.flush
[alpha, beta].each(&:join)

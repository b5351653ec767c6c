# Two threads on CPU at once: alpha runs Ruby code holding the GVL, beta
# compresses with zlib, which releases the GVL. A profiler that reads the GVL
# holder's stack would put beta's CPU time under alpha's methods.
require "zlib"

def alpha_work
  x = 0
  20_000.times { |i| x += i }
  x
end

def alpha_loop
  # Let beta take the GVL now and then: it hands it back while deflating.
  # Ruby 3.4's zlib takes the GVL back for each chunk it deflates, so beta
  # gets a chunk per pass: with a pass every 200,000 additions it ran 0.07 s
  # a second (the frames test then took 6 s alone, 33 s beside another
  # suite), every 20,000 about 0.5 s. The other Rubies run beta on a CPU of
  # its own either way.
  loop { alpha_work; Thread.pass }
end

def beta_work(data)
  Zlib::Deflate.deflate(data, Zlib::BEST_COMPRESSION)
end

def beta_loop
  data = Random.new(1).bytes(1 << 20) * 4
  loop { beta_work(data) }
end

named = Queue.new
alpha = Thread.new { Thread.current.name = "alpha"; named << 1; alpha_loop }
beta = Thread.new { Thread.current.name = "beta"; named << 1; beta_loop }
2.times { named.pop }
# Thread#native_thread_id exists from Ruby 3.1; the test falls back to names.
tid = ->(t) { t.respond_to?(:native_thread_id) ? t.native_thread_id : "?" }
$stdout.puts "ready alpha=#{tid[alpha]} beta=#{tid[beta]} main=#{tid[Thread.main]}"
$stdout.flush
[alpha, beta].each(&:join)

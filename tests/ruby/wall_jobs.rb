# A job system shaped like a Sidekiq process, for `wall`'s running time:
# five threads run jobs, each a query to a "database" (a forked process that
# answers after 4 ms), whose rows take 3 ms of CPU to decode, an HTTP call to
# it (answered after 3 ms, 1 ms to parse), 6 ms of crunching and a 2 ms
# sleep. Most of a thread's CPU comes in short bursts right after a wait:
# whatever profiler gives a burst's time to the next sample's stack gives
# decoding to crunching. Each method's CPU time, by its thread's CPU clock,
# is printed ten times a second ("cpu query_db=NS http_call=NS crunch=NS"),
# the truth rprof's shares are held to. With an argument, every time is
# that many times as long. Says ready when every thread has run a job; runs
# until killed.
require "socket"

THREADS = 5
SCALE = Float(ARGV[0] || 1)
MS = 1_000_000 * SCALE

def cpu_now
  Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID, :nanosecond)
end

# Ruby work until this thread has had `ns` more of CPU.
def burn(ns)
  until_t = cpu_now + ns
  x = 0
  x += 1 while cpu_now < until_t
  x
end

$cpu = Hash.new(0)

def timed(name)
  t = cpu_now
  yield
ensure
  $cpu[name] += cpu_now - t
end

def decode_rows(ms) = burn(ms * MS)
def parse_body(ms) = burn(ms * MS)

def query_db(io)
  timed(:query_db) do
    io.write("q\n")
    io.gets
    decode_rows(3)
  end
end

def http_call(io)
  timed(:http_call) do
    io.write("h\n")
    io.gets
    parse_body(1)
  end
end

def crunch
  timed(:crunch) { burn(6 * MS) }
end

def perform(io)
  query_db(io)
  http_call(io)
  crunch
  sleep 0.002 * SCALE
end

server = TCPServer.new("127.0.0.1", 0)
port = server.addr[1]
# The database ends with this process, however it ends: at EOF on a pipe
# only this process writes to.
alive_r, alive_w = IO.pipe
database = fork do
  alive_w.close
  Thread.new do
    alive_r.read
    exit!(0)
  end
  loop do
    client = server.accept
    Thread.new(client) do |c|
      while (line = c.gets)
        sleep((line == "q\n" ? 0.004 : 0.003) * SCALE)
        c.write("ok\n")
      end
    rescue SystemCallError
      # the job system ended
    end
  end
end
server.close
alive_r.close
Process.detach(database)

started = Queue.new
THREADS.times do |i|
  Thread.new do
    Thread.current.name = "job-#{i}"
    io = TCPSocket.new("127.0.0.1", port)
    io.sync = true
    perform(io)
    started << 1
    loop { perform(io) }
  end
end
THREADS.times { started.pop }
$stdout.puts "ready"
$stdout.flush
loop do
  sleep 0.1
  $stdout.puts "cpu " + %i[query_db http_call crunch].map { |k| "#{k}=#{$cpu[k]}" }.join(" ")
  $stdout.flush
end

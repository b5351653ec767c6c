# A Rack app for the wall tests: GET /backend burns 30 ms of the thread's CPU
# in WallApp#burn, then waits for a backend on $BACKEND_PORT that answers
# after 70 ms (WallApp#fetch); GET /sleep burns the same, then sleeps 70 ms
# (WallApp#nap).
require "socket"

class WallApp
  def call(env)
    burn(0.030)
    env["PATH_INFO"] == "/sleep" ? nap : fetch
    [200, { "content-type" => "text/plain" }, ["ok\n"]]
  end

  def burn(cpu_seconds)
    clock = Process::CLOCK_THREAD_CPUTIME_ID
    until_cpu = Process.clock_gettime(clock) + cpu_seconds
    x = 0
    x += 1 while Process.clock_gettime(clock) < until_cpu
    x
  end

  def fetch
    TCPSocket.open("127.0.0.1", Integer(ENV.fetch("BACKEND_PORT"))) do |s|
      s.write("?")
      s.read(1)
    end
  end

  def nap
    sleep 0.070
  end
end

run WallApp.new

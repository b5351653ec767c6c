# Threads parked in known states, for `rprof record ... wall`: two threads
# on CPU (sharing the GVL), one asleep, one reading a pipe nobody writes,
# one waiting for it in IO.select,
# one reading a TCP connection whose other end never writes, one reading the
# other end (accepted by the server), the same two over a Unix socket, one
# waiting for a connection nobody makes, one waiting for a Mutex another thread holds,
# one in Queue#pop, and the main thread in Thread#join. Each waits in a
# method named for its state. The ready line gives the ports.
require "socket"
require_relative "unix_pair"

def spin
  x = 0
  loop { x += 1 }
end

def nap
  sleep
end

def read_pipe(r)
  r.read(1)
end

def select_pipe(r)
  IO.select([r])
end

def read_socket(s)
  s.read(1)
end

def read_client(s)
  s.read(1)
end

def read_unix(s)
  s.read(1)
end

def serve_unix(s)
  s.read(1)
end

def accept_one(server)
  server.accept
end

def hold(lock, held)
  lock.synchronize do
    held << 1
    sleep
  end
end

def lock_mutex(lock)
  lock.synchronize { nil }
end

def pop_queue(q)
  q.pop
end

def join_all(threads)
  threads.each(&:join)
end

r, _w = IO.pipe
server = TCPServer.new("127.0.0.1", 0)
client = TCPSocket.new("127.0.0.1", server.addr[1])
accepted = server.accept
idle = TCPServer.new("127.0.0.1", 0)
_unix_server, unix_client, unix_accepted, unix_path = unix_pair("wall-states")
lock = Mutex.new
held = Queue.new
queue = Queue.new
named = Queue.new
start = lambda do |name, &body|
  Thread.new do
    Thread.current.name = name
    named << 1
    body.call
  end
end
threads = [
  start.call("cpu1") { spin },
  start.call("cpu2") { spin },
  start.call("sleeper") { nap },
  start.call("reader") { read_pipe(r) },
  start.call("selector") { select_pipe(r) },
  start.call("netreader") { read_socket(client) },
  start.call("netserver") { read_client(accepted) },
  start.call("unixreader") { read_unix(unix_client) },
  start.call("unixserver") { serve_unix(unix_accepted) },
  start.call("acceptor") { accept_one(idle) },
  start.call("holder") { hold(lock, held) }
]
threads.size.times { named.pop }
held.pop
threads << start.call("locker") { lock_mutex(lock) }
threads << start.call("popper") { pop_queue(queue) }
2.times { named.pop }
tid = ->(t) { t.respond_to?(:native_thread_id) ? t.native_thread_id : "?" }
# Until every thread but the two spinning ones is parked, ready is not said.
sleep 0.01 until threads.drop(2).all? { |t| t.status == "sleep" }
ports = "server_port=#{server.addr[1]} idle_port=#{idle.addr[1]} unix_path=#{unix_path}"
$stdout.puts "ready " + threads.map { |t| "#{t.name}=#{tid[t]}" }.join(" ") + " main=#{tid[Thread.main]} #{ports}"
$stdout.flush
join_all(threads)

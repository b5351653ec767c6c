# One thread waits for data on a socket while the main thread spins and
# never sleeps: on Ruby 2.7-3.2 the waiting thread is then the one that takes
# the VM's signal eventfd, and polls it beside the socket (a poll of two
# descriptors). The main thread sends a byte every 0.3 s, so that the waits
# after the first begin while rprof records. The ready line gives the port
# of the peer the waiter's socket is connected to. With `select`, the
# waiter waits in IO.select (a select of the same descriptors).
require "socket"
require "io/wait"

def wait_data(s)
  s.wait_readable
  s.read_nonblock(1)
end

def select_data(s)
  IO.select([s])
  s.read_nonblock(1)
end

def clock
  Process.clock_gettime(Process::CLOCK_MONOTONIC)
end

server = TCPServer.new("127.0.0.1", 0)
client = TCPSocket.new("127.0.0.1", server.addr[1])
sender = server.accept
waiter = Thread.new do
  Thread.current.name = "waiter"
  if ARGV[0] == "select"
    loop { select_data(client) }
  else
    loop { wait_data(client) }
  end
end
# Spins (a sleep would take the eventfd) until the waiter waits.
Thread.pass until waiter.status == "sleep"
$stdout.puts "ready peer_port=#{server.addr[1]}"
$stdout.flush
sent = clock
loop do
  next if clock - sent < 0.3
  sender.write("x")
  sent = clock
end

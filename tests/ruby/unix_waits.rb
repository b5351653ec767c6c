# Three threads wait again and again (20 ms at a time) on Unix sockets, so
# that their waits begin while rprof records and are walked in BPF: one on a
# listening socket, one on the server's end of a connection it accepted, one
# on the client's end. Each waits in a method named for its socket. The
# ready line gives the path the server listens on.
require "io/wait"
require_relative "unix_pair"

def wait_listening(s)
  s.wait_readable(0.02)
end

def wait_accepted(s)
  s.wait_readable(0.02)
end

def wait_client(s)
  s.wait_readable(0.02)
end

server, client, accepted, path = unix_pair("unix-waits")
started = Queue.new
threads = {
  "listener" => -> { wait_listening(server) },
  "accepted" => -> { wait_accepted(accepted) },
  "client" => -> { wait_client(client) }
}.map do |name, wait|
  Thread.new do
    Thread.current.name = name
    started << "#{name}=#{Thread.current.native_thread_id}"
    loop { wait.call }
  end
end
tids = threads.map { started.pop }.join(" ")
$stdout.puts "ready #{tids} path=#{path}"
$stdout.flush
threads.each(&:join)

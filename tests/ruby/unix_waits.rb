# Threads wait again and again (20 ms at a time) on Unix sockets, so that
# their waits begin while rprof records and are walked in BPF: one on a
# listening socket, one on the server's end of a connection it accepted,
# one on the client's end; one on the server's end of a new connection each
# time (accepted after rprof read the namespace's tables); one on a bound
# datagram socket and one on a datagram socket connected to it. Each waits
# in a method named for its socket. The ready line gives the paths (an
# abstract name as /proc/net/unix shows it: `@` for its NUL). With
# `parked`, each waits once, for ever: its wait is under way when rprof
# looks, and rprof reads its stack and socket from userspace.
require "io/wait"
require "socket"
require_relative "unix_pair"

TIMEOUT = ARGV[0] == "parked" ? nil : 0.02

def wait_listening(s)
  s.wait_readable(TIMEOUT)
end

def wait_accepted(s)
  s.wait_readable(TIMEOUT)
end

def wait_client(s)
  s.wait_readable(TIMEOUT)
end

def wait_fresh(s)
  s.wait_readable(TIMEOUT)
end

def wait_bound(s)
  s.wait_readable(TIMEOUT)
end

def wait_dgram_client(s)
  s.wait_readable(TIMEOUT)
end

server, client, accepted, path = unix_pair("unix-waits")
fresh_name = "\0rprof-unix-fresh-#{Process.pid}"
fresh_server = UNIXServer.new(fresh_name)
fresh = lambda do
  c = UNIXSocket.new(fresh_name)
  a = fresh_server.accept
  wait_fresh(a)
  a.close
  c.close
end
bound_name = "\0rprof-unix-bound-#{Process.pid}"
bound = Socket.new(:UNIX, :DGRAM)
bound.bind(Addrinfo.unix(bound_name))
dgram_client = Socket.new(:UNIX, :DGRAM)
dgram_client.connect(Addrinfo.unix(bound_name))
started = Queue.new
threads = {
  "listener" => -> { wait_listening(server) },
  "accepted" => -> { wait_accepted(accepted) },
  "client" => -> { wait_client(client) },
  "fresh" => fresh,
  "bound" => -> { wait_bound(bound) },
  "dgramclient" => -> { wait_dgram_client(dgram_client) }
}.map do |name, wait|
  Thread.new do
    Thread.current.name = name
    started << "#{name}=#{Thread.current.native_thread_id}"
    loop { wait.call }
  end
end
tids = threads.map { started.pop }.join(" ")
shown = ->(name) { name.tr("\0", "@") }
$stdout.puts "ready #{tids} path=#{path} fresh_path=#{shown.(fresh_name)} bound_path=#{shown.(bound_name)}"
$stdout.flush
threads.each(&:join)

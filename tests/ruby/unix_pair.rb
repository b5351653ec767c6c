# A Unix socket server in the temporary directory, a client connected to it,
# and the server's end of that connection: [server, client, accepted, path].
# The path is unlinked at once (the tests kill their programs); it stays the
# sockets' address in the kernel's table.
require "socket"
require "tmpdir"

def unix_pair(name)
  path = File.join(Dir.tmpdir, "rprof-#{name}-#{Process.pid}.sock")
  server = UNIXServer.new(path)
  client = UNIXSocket.new(path)
  accepted = server.accept
  File.unlink(path)
  [server, client, accepted, path]
end

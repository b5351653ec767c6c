# A Ruby that collects for a while (as a Puma master booting an app), then
# forks a child that waits: the child's GC clock (GC.stat(:time)), a copy
# of its parent's, counts the parent's collections, which the child's own
# CPU time does not. The child says "ready child=PID gc_ms=N" once forked,
# and reads a pipe that only its parent holds open: it ends with it.
keep = []
until GC.stat(:time) >= 300
  keep << Array.new(10_000) { |i| "s#{i}" }
  keep.shift if keep.size > 20
  GC.start
end
r, w = IO.pipe
child = fork do
  w.close
  $stdout.puts "ready child=#{Process.pid} gc_ms=#{GC.stat(:time)}"
  $stdout.flush
  r.read
end
r.close
Process.wait(child)

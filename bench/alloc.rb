# The allocation workload of bench/alloc-cost: waits for "go" on stdin, then
# makes N objects (Foo.new, a string, a two-element array, in turn) from a
# 10-frame deep Ruby stack, prints "made N elapsed SECONDS" and exits.
N = Integer(ARGV.fetch(0, "1000000"))

class Foo; end

def dive(depth, &blk)
  depth.zero? ? blk.call : dive(depth - 1, &blk)
end

def churn
  i = 0
  a = nil
  while i < N
    case i % 3
    when 0 then a = Foo.new
    when 1 then a = i.to_s
    else a = [i, i]
    end
    i += 1
  end
  a
end

3.times { GC.start }
$stdout.puts "ready"
$stdout.flush
$stdin.gets
dive(7) do # <main>, 8 dive, the block, churn: 10 frames at each allocation
  t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
  churn
  $stdout.puts "made #{N} elapsed #{Process.clock_gettime(Process::CLOCK_MONOTONIC) - t}"
  $stdout.flush
end

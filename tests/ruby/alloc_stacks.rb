# Allocations at full speed from thousands of stacks: 3,000 methods, each
# calling another three deep, the last making a string. Every minor GC
# makes each stack new to rprof (its GC time is part of a stack's hash in
# BPF), so an epoch counts more stacks than one batch of the in-kernel
# table holds. Says ready, then runs until killed.
N = 3000
N.times do |i|
  eval "def m#{i}(d) = d.zero? ? \"s\" * 8 : m#{(i * 7 + 1) % N}(d - 1)", binding, __FILE__, __LINE__
end
$stdout.puts "ready"
$stdout.flush
i = 0
loop do
  send(:"m#{i % N}", 3)
  i += 1
end

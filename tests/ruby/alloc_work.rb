# Known allocations for `rprof record ... alloc`: after a line on stdin,
# `make_foos` allocates N objects of class Foo, `make_strings` 2N strings
# (Integer#to_s), `make_arrays` 3N arrays, and nothing else does; `mixed`
# makes objects of six kinds, as GC.stat counts them; then it prints
# "done mixed=(its objects by GC.stat)" and sleeps. With `spin` instead, it loops forever without
# allocating anything. Each allocation's line is fixed (see the tests).
class Foo; end

def make_foos(n)
  i = 0
  while i < n
    Foo.new # line 12
    i += 1
  end
end

def make_strings(n)
  i = 0
  while i < n
    i.to_s # line 20
    i += 1
  end
end

def make_arrays(n)
  i = 0
  while i < n
    a = [i, i] # line 28
    i += 1
  end
  a
end

S = Struct.new(:a, :b)

# One of each of the rest a program makes (a lambda is a T_DATA, made by
# its own allocation functions), N times: 6N objects.
def mixed(n)
  i = 0
  x = nil
  while i < n
    x = [-> { i }, S.new(i, i), Hash.new, Object.new, "s#{i}"] # line 42
    i += 1
  end
  x
end

def spin
  i = 0
  while true
    i += 1
  end
end

n = Integer(ARGV.fetch(0, "10000"))
# The code made old, as a long-running program's is: rprof names a young
# object's frame only if no GC may have freed it since the event.
3.times { GC.start }
$stdout.sync = true
if ARGV[1] == "spin"
  puts "ready"
  spin
end
puts "ready"
$stdin.gets
make_foos(n)
make_strings(2 * n)
make_arrays(3 * n)
before = GC.stat(:total_allocated_objects)
mixed(n)
puts "done mixed=#{GC.stat(:total_allocated_objects) - before}"
sleep

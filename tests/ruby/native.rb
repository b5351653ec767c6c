# The --native tests' program: `ruby native.rb PHASE [EXT_DIR]`.
#   ext    RprofNative.burn (a -> b -> c in C) from Object#burner, and
#          RprofNative.yield_each with a Ruby block that burns CPU, from
#          Object#yielder, taking turns (EXT_DIR holds the built extension)
#   sort   Array#sort of 30,000 integers, from Object#sorter: small enough that
#          Array#sort's copy of it (rb_ary_dup) stays in the cache; with
#          300,000 the copy took 3-6% of Array#sort idle and 11% in a CI run
#          (ci86), where the tests want sorting (rb_ary_sort_bang) >= 90%
#   gc     allocation that keeps the GC busy, from Object#allocator
#   exist  a thread "exister" calling File.exist? (the GVL released around
#          its stat) while the main thread waits for it
#   signal RprofNative.signal_burn (burning in a signal handler) from Object#signaler
#   nocfi  RprofNative.no_cfi_burn (a function without CFI) from Object#nocfi
#   deep   RprofNative.deep (200 native frames, then a burn) from Object#diver
#   late   like ext's burner, but the extension is loaded only on SIGUSR1
#          (after the profiler has read the process's mappings)
# Prints "ready" once it runs the phase.
phase, ext_dir = ARGV
$stdout.sync = true

def burner
  RprofNative.burn(10_000_000) # HOT burner
end

def yielder
  RprofNative.yield_each(20) do |i|
    x = 0
    20_000.times { |j| x += j ^ i } # HOT block in yielder
    x
  end
end

def sorter(a)
  a.sort # HOT sorter
end

def allocator
  Array.new(1_000) { |i| "x" * (i % 64) } # HOT allocator
end

def exister(path)
  File.exist?(path) # HOT exister
end

def signaler
  RprofNative.signal_burn(2_000_000)
end

def nocfi
  RprofNative.no_cfi_burn(50_000_000)
end

def diver
  RprofNative.deep(200, 5_000_000)
end

case phase
when "late"
  go, signalled = IO.pipe
  trap("USR1") { signalled.write_nonblock("x") }
  puts "ready"
  go.read(1)
  $LOAD_PATH.unshift(ext_dir)
  require "rprof_native"
  puts "loaded"
  loop { burner }
when "ext", "signal", "nocfi", "deep"
  $LOAD_PATH.unshift(ext_dir)
  require "rprof_native"
  # YJIT compiles a method at its 30th call (Ruby 3.3's threshold): until
  # then the interpreter runs it, and its native stacks are whole. The
  # tests of JIT code want it compiled before they record (ci131: 56 of
  # 1,096 samples were before, as rprof started while it warmed up).
  40.times { burner; yielder } if phase == "ext" && defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled?
  puts "ready"
  case phase
  when "ext" then loop { burner; yielder }
  when "signal" then loop { signaler }
  when "nocfi" then loop { nocfi }
  when "deep" then loop { diver }
  end
when "sort"
  arr = Array.new(30_000) { |i| (i * 7919) % 30_011 }
  puts "ready"
  loop { sorter(arr) }
when "gc"
  puts "ready"
  loop { allocator }
when "exist"
  t = Thread.new do
    Thread.current.name = "exister"
    loop { exister("/nonexistent/rprof") }
  end
  puts "ready"
  t.join
else
  abort "unknown phase #{phase.inspect}"
end

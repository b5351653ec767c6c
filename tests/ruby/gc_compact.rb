# One thread that compacts its heap (GC.compact in `compact_it`) over and
# over between rounds of allocation, for rprof's `[GC: compacting]` frame.
# Runs until killed.
KEEP = Array.new(300_000) { |i| "kept #{i}" }

def compact_it
  GC.compact
end

def allocate
  a = []
  200_000.times { |i| a << "x#{i}" }
end

$stdout.puts "ready main=#{Thread.main.respond_to?(:native_thread_id) ? Thread.main.native_thread_id : '?'}"
$stdout.flush
loop do
  compact_it
  allocate
end

# Thread "syscaller" loops x -> y -> z making system calls; thread "cruncher"
# loops a -> b -> c. MODE (ARGV[0]):
#   stat:   z calls File.exist? (newfstatat without the GVL); c only computes.
#   getpid: z calls Process.pid then Thread.pass; c writes to $stderr.
MODE = ARGV.fetch(0)
$stderr.reopen(File::NULL, "w") if MODE == "getpid"

def z
  if MODE == "stat"
    File.exist?("/nonexistent/rprof-test")
  else
    Process.pid
    Thread.pass
  end
end

def y = z
def x = y

def c
  if MODE == "stat"
    s = 0
    1_000.times { |i| s += i }
    s
  else
    $stderr.write("rprof\n")
  end
end

def b = c
def a = b

syscaller = Thread.new { Thread.current.name = "syscaller"; loop { x } }
cruncher = Thread.new { Thread.current.name = "cruncher"; loop { a } }
sleep 0.05 until syscaller.native_thread_id && cruncher.native_thread_id
$stdout.puts "ready syscaller=#{syscaller.native_thread_id} cruncher=#{cruncher.native_thread_id} main=#{Thread.main.native_thread_id}"
$stdout.flush
sleep

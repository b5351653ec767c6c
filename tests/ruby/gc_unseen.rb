# Thread "looper" loops x -> y -> z calling Process.pid (getpid, allocating
# nothing: no GC of its own). Once SIGUSR1 comes, the main thread runs a
# minor GC, lets the looper run in that GC's time, runs a major GC, lets it
# run again, and prints "gcs" with the counts GC.stat gave after each.
def z = Process.pid
def y = z
def x = y

looper = Thread.new { loop { x } }
sleep 0.05 until looper.native_thread_id
# Everything so far old (promoted): only a major GC may free it.
4.times { GC.start }
go_r, go_w = IO.pipe
trap("USR1") { go_w.syswrite("g") }
$stdout.puts "ready looper=#{looper.native_thread_id}"
$stdout.flush
go_r.read(1)
GC.start(full_mark: false)
minor = [GC.stat(:count), GC.stat(:major_gc_count)]
sleep 0.3
GC.start
major = [GC.stat(:count), GC.stat(:major_gc_count)]
sleep 0.3
$stdout.puts "gcs minor=#{minor.join(",")} major=#{major.join(",")}"
$stdout.flush
sleep

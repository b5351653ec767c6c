# Four threads wait on a file, a device and a pipe: `flocker` for a lock
# file's lock, which the main thread holds (flock), `ttyreader` for a
# terminal nobody types into (a pty's other end), `popenreader` for
# the output of a child (`cat`, given no input: it ends with this
# program, when its input closes), `selector` for the same output in
# IO.select, and `pipelinereader` for the output of a shell's pipeline
# (`cat | cat`, which ends as `cat` does). Each waits once, for
# ever, in a method named for it. With `parked` they start at once, before
# rprof looks; else on SIGUSR1, so that their waits begin while rprof
# records, and a line "started" gives their thread ids. The ready line
# gives the lock file's and the terminal's paths (the tests remove the lock
# file), the child's PID, and the pipeline's shell's PID and the descriptor
# it is read from.
require "pty"
require "tmpdir"

def wait_flock(f)
  f.flock(File::LOCK_EX)
end

def read_tty(io)
  io.read(1)
end

def read_child(io)
  io.read(1)
end

def select_child(io)
  IO.select([io])
end

def read_pipeline(io)
  io.read(1)
end

lock_path = File.join(Dir.tmpdir, "rprof-file-waits-#{Process.pid}.lock")
holder = File.open(lock_path, File::RDWR | File::CREAT)
holder.flock(File::LOCK_EX)
waiter = File.open(lock_path, File::RDWR)
_master, tty = PTY.open
child = IO.popen(["cat"], "r+")
pipeline = IO.popen("cat | cat", "r+")

start = lambda do
  started = Queue.new
  {
    "flocker" => -> { wait_flock(waiter) },
    "ttyreader" => -> { read_tty(tty) },
    "popenreader" => -> { read_child(child) },
    "selector" => -> { select_child(child) },
    "pipelinereader" => -> { read_pipeline(pipeline) }
  }.each do |name, wait|
    Thread.new do
      Thread.current.name = name
      started << "#{name}=#{Thread.current.native_thread_id}"
      wait.call
    end
  end
  5.times.map { started.pop }.join(" ")
end

paths = "lock_path=#{lock_path} tty_path=#{tty.path} child_pid=#{child.pid} " \
        "pipeline_pid=#{pipeline.pid} pipeline_fd=#{pipeline.fileno}"
if ARGV[0] == "parked"
  $stdout.puts "ready #{start.call} #{paths}"
  $stdout.flush
else
  go = false
  trap("USR1") { go = true }
  $stdout.puts "ready #{paths}"
  $stdout.flush
  sleep 0.005 until go
  $stdout.puts "started #{start.call}"
  $stdout.flush
end
sleep

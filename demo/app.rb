# rprof's demo: a small "web app" that renders JSON pages and compresses them
# on worker threads for a few seconds, then exits. `make demo` profiles it.
require "json"
require "zlib"
require "digest"

class Catalog
  def initialize
    @items = (1..2_000).map { |i| { id: i, name: "item-#{i}", price: i * 1.07, tags: %w[a b c].sample(2) } }
  end

  def page(n)
    @items.each_slice(50).to_a[n % 40]
  end
end

class Renderer
  def render(items)
    JSON.generate(items.map { |it| it.merge(sku: Digest::SHA256.hexdigest(it[:name])) })
  end
end

class Compressor
  def compress(body)
    Zlib::Deflate.deflate(body * 20, Zlib::BEST_COMPRESSION)
  end
end

def handle(catalog, renderer, compressor, n)
  compressor.compress(renderer.render(catalog.page(n)))
end

seconds = Float(ARGV.fetch(0, "5"))
catalog = Catalog.new
renderer = Renderer.new
compressor = Compressor.new
deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + seconds
workers = 2.times.map do |w|
  Thread.new do
    Thread.current.name = "worker-#{w}"
    n = 0
    n += 1 while handle(catalog, renderer, compressor, n) && Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
  end
end
workers.each(&:join)

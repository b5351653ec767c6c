# A Rack app whose every request burns CPU in HotApp#handle.
class HotApp
  def call(_env)
    handle
    [200, { "content-type" => "text/plain" }, ["ok\n"]]
  end

  def handle
    x = 0
    x += 1 while x < 200_000
    x
  end
end

run HotApp.new

# A one-file Rails 6.1 app shaped as production runs one: templates and
# partials from files, compiled once (cache_template_loading, as in
# production), so that their code is old objects a few GCs after the first
# request, under long-lived framework code. Each request renders a 200-row
# table, a partial per row, with number_to_currency.
require "action_controller/railtie"

class RprofRailsViewsApp < Rails::Application
  config.eager_load = true
  config.cache_classes = true
  config.action_view.cache_template_loading = true
  config.secret_key_base = "rprof" * 13
  config.logger = Logger.new(nil)
  config.hosts.clear
  routes.append { root to: "rows#index" }
end

ROWS = (1..200).map { |i| [i, "item #{i}", i * 3.25] }.freeze

class RowsController < ActionController::Base
  prepend_view_path File.expand_path("rails_views", __dir__)

  def index
    render :index, locals: { rows: ROWS }
  end
end

RprofRailsViewsApp.initialize!
# As rails.ru: the tests wait for this line, once the app has booted.
$stdout.puts "rails booted #{Process.pid}"
$stdout.flush
run RprofRailsViewsApp

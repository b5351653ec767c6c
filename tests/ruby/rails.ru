# A one-file Rails 6.1 app (Debian's ruby-railties, ruby-actionpack,
# ruby-actionview): each request renders a 200-row ERB table with
# number_to_currency from an inline template, which Rails compiles into a
# new method on every request (young code, freed by a later GC), under
# long-lived framework code (old objects after boot).
require "action_controller/railtie"

class RprofRailsApp < Rails::Application
  config.eager_load = true
  config.secret_key_base = "rprof" * 13
  config.logger = Logger.new(nil)
  config.hosts.clear
  routes.append { root to: "rows#index" }
end

ROWS = (1..200).map { |i| [i, "item #{i}", i * 3.25] }.freeze

class RowsController < ActionController::Base
  TEMPLATE = <<~ERB
    <table>
    <% rows.each do |id, name, price| %>
      <tr><td><%= id %></td><td><%= name %></td><td><%= number_to_currency(price) %></td></tr>
    <% end %>
    </table>
  ERB

  def index
    render inline: TEMPLATE, locals: { rows: ROWS }
  end
end

RprofRailsApp.initialize!
# Puma loads this file in each worker after the worker says it booted (no
# preload_app!): the tests wait for this line, so that the app's boot, its
# eager loading included, is over before they record.
$stdout.puts "rails booted #{Process.pid}"
$stdout.flush
run RprofRailsApp

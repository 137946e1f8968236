/* Metrics charts: fetch a metrics endpoint of the REST API and draw it with uPlot.
   Each chart's uPlot instance is kept in window.metricsCharts[<element id>] (the browser test reads it).
   Times are UTC on a 24-hour clock, like the tables. The charts refresh every REFRESH_MS while the
   "Live" toggle is on and the tab is visible; a fetch never starts while the previous one runs. The range
   links switch the range in place (they still work as plain links without JavaScript). */
(function () {
  "use strict";

  var REFRESH_MS = 15000;
  var PALETTE = ["#1f6feb", "#d1242f", "#1a7f37", "#8250df", "#bf8700", "#0a7ea4", "#cf222e", "#57606a"];
  var DASHES = { p50: [], p95: [6, 4], p99: [2, 3], mean: [] };
  var markersFor = {};
  window.metricsCharts = {};

  function pad(n) { return n < 10 ? "0" + n : "" + n; }

  function utc(ts, withDate) {
    var d = new Date(ts * 1000);
    var time = pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes());
    if (!withDate) { return time; }
    return d.getUTCFullYear() + "-" + pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate()) + " " + time;
  }

  function timeTicks(u, splits) {
    var wide = u.scales.x.max - u.scales.x.min > 86400;
    return splits.map(function (ts) {
      var d = new Date(ts * 1000);
      return (wide ? pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate()) + " " : "") + utc(ts, false);
    });
  }

  function fmt(unit, digits) {
    return function (u, v) { return v == null ? "–" : v.toFixed(digits) + unit; };
  }

  /* Deploys, switches and rollbacks as vertical lines over the plot, each with a label whose tooltip says
     what happened and when. DOM elements (not canvas strokes) so they carry a tooltip and can be tested. */
  function markerPlugin(id) {
    function place(u) {
      var layer = u.over.querySelector(".chart-markers");
      if (!layer) {
        layer = document.createElement("div");
        layer.className = "chart-markers";
        u.over.appendChild(layer);
      }
      layer.textContent = "";
      var shown = 0;
      (markersFor[id] || []).forEach(function (m) {
        if (u.scales.x.min == null || m.time < u.scales.x.min || m.time > u.scales.x.max) { return; }
        var line = document.createElement("div");
        line.className = "chart-marker marker-" + m.kind;
        line.dataset.kind = m.kind;
        line.style.left = Math.round(u.valToPos(m.time, "x")) + "px";
        var label = document.createElement("span");
        label.textContent = m.label;
        label.title = utc(m.time, true) + " UTC · " + m.label + ": " + m.message;
        label.style.top = (shown++ % 3) * 1.4 + "em";  // staggered, so close events stay readable
        line.appendChild(label);
        layer.appendChild(line);
      });
    }
    return { hooks: { ready: place, setData: place, setSize: place, setScale: place } };
  }

  function draw(id, timestamps, lines, unit, digits, markers) {
    var el = document.getElementById(id);
    if (!el) { return null; }
    markersFor[id] = markers || [];
    var data = [timestamps].concat(lines.map(function (line) { return line.values; }));
    var labels = lines.map(function (line) { return line.label; }).join("|");
    var existing = window.metricsCharts[id];
    if (existing && existing.seriesLabels === labels) {
      existing.setData(data);  // a refresh: same lines, new points
      return existing;
    }
    if (existing) { existing.destroy(); }
    el.textContent = "";
    var series = [{ label: "time (UTC)", value: function (u, ts) { return ts == null ? "–" : utc(ts, true) + " UTC"; } }];
    lines.forEach(function (line, i) {
      var one = {
        label: line.label,
        stroke: line.color || PALETTE[i % PALETTE.length],
        dash: line.dash || [],
        width: 2,
        points: { show: false },
        value: fmt(unit, digits),
      };
      // A count that holds until it changes (replicas): steps, not slopes between the points.
      if (line.stepped && uPlot.paths && uPlot.paths.stepped) { one.paths = uPlot.paths.stepped({ align: 1 }); }
      series.push(one);
    });
    var plot = new uPlot({
      width: Math.max(el.clientWidth, 240),
      height: 220,
      series: series,
      // Ticks fall on whole UTC minutes/hours/days, whatever the browser's time zone.
      tzDate: function (ts) { return uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"); },
      scales: { x: { time: true }, y: { range: function (u, min, max) { return [0, max > 0 ? max * 1.1 : 1]; } } },
      axes: [
        { values: timeTicks, label: "UTC", labelSize: 18, labelFont: "12px system-ui" },
        { size: 72, values: function (u, ticks) { return ticks.map(function (t) { return +t.toFixed(3) + unit; }); } },
      ],
      legend: { live: true },
      plugins: [markerPlugin(id)],
    }, data, el);
    plot.seriesLabels = labels;
    window.metricsCharts[id] = plot;
    return plot;
  }

  function percent(values) {
    return values.map(function (v) { return v == null ? null : v * 100; });
  }

  /* The gateway's figures (HAProxy): requests it forwarded, refusals it answered itself, bad requests (400:
     the caller's error) and server errors (5xx) apart. */
  function drawGateway(id, ts, g, markers) {
    if (!g) { return; }
    draw(id, ts, [
      { label: "requests", color: PALETTE[0], values: g.requests_per_second },
      { label: "401", color: PALETTE[4], values: g.unauthorized_per_second },
      { label: "404", color: PALETTE[7], values: g.not_found_per_second },
      { label: "429", color: PALETTE[3], values: g.rate_limited_per_second },
      { label: "400 bad request", color: PALETTE[5], values: g.bad_requests_per_second },
      { label: "5xx", color: PALETTE[1], values: g.server_errors_per_second },
      { label: "batch class", color: PALETTE[6], values: g.batch_per_second },
    ], "/s", 2, markers);
  }

  function gatewayTotals(g) {
    var t = g.totals;
    return "At the gateway: " + t.requests + " requests, " + t.responses_5xx + " 5xx (server errors), " +
      t.responses_400 + " × 400 (bad requests); refused " +
      t.responses_401 + " × 401, " + t.responses_404 + " × 404, " + t.responses_429 + " × 429; by priority class " +
      t.requests_interactive + " interactive, " + t.requests_batch + " batch.";
  }

  var RENDER = {
    model: function (root, d) {
      var ts = d.timestamps;
      var versions = d.versions;
      var markers = d.markers || [];
      function perVersion(key, transform) {
        return versions.map(function (v, i) {
          return { label: "v" + v.version, color: PALETTE[i % PALETTE.length], values: transform ? transform(v[key]) : v[key] };
        });
      }
      draw("chart-requests", ts, perVersion("requests_per_second"), "", 2, markers);
      var latency = [];
      versions.forEach(function (v, i) {
        // Real percentiles where Triton's summaries are on; otherwise the mean, never called a percentile.
        var keys = v.latency === "quantiles" ? ["p50", "p95", "p99"] : ["mean"];
        keys.forEach(function (q) {
          var key = q === "mean" ? "avg_latency_ms" : q + "_ms";
          latency.push({ label: "v" + v.version + " " + q, color: PALETTE[i % PALETTE.length], dash: DASHES[q], values: v[key] });
        });
      });
      if (d.gateway) {
        // Time at the gateway (request in to last byte out) beside Triton's: the difference is the gateway's.
        latency.push({ label: "gateway mean", color: "#57606a", dash: [8, 3, 2, 3], values: d.gateway.avg_ms });
      }
      var title = root.querySelector(".latency-title");
      if (title) { title.textContent = "Latency " + d.latency_label + " (ms)"; }
      draw("chart-latency", ts, latency, " ms", 2, markers);
      draw("chart-queue", ts, perVersion("queue_ms"), " ms", 3, markers);
      draw("chart-batch", ts, perVersion("avg_batch_size"), "", 2, markers);
      draw("chart-errors", ts, perVersion("error_rate", percent), "%", 2, markers);
      drawGateway("chart-gateway", ts, d.gateway, markers);
      if (d.replicas) {
        // An autoscaled deployment: its replicas (desired, ready) with the autoscaler's decisions as markers.
        draw("chart-replicas", ts, [
          { label: "desired", color: PALETTE[0], values: d.replicas.desired, stepped: true },
          { label: "ready", color: PALETTE[2], dash: [6, 4], values: d.replicas.ready, stepped: true },
        ], "", 0, d.replicas.markers);
        var now = root.querySelector(".replicas-now");
        if (now) {
          now.textContent = d.replicas.ready_now + " of " + d.replicas.desired_now + " replicas ready now (" +
            d.replicas.min_replicas + ".." + d.replicas.max_replicas + ")";
        }
      }
      var totals = root.querySelector(".metric-totals");
      if (totals) {
        var reasons = Object.keys(d.failure_reasons).map(function (k) { return k + " " + d.failure_reasons[k]; }).join(", ");
        totals.textContent = d.totals.requests + " requests, " + d.totals.failure + " failed" +
          (reasons ? " (" + reasons + ")" : "") + ", " + d.totals.client_errors + " bad requests (400, not failures)" +
          " in the last " + d.range + "." +
          (d.gateway ? " " + gatewayTotals(d.gateway) : "");
        totals.hidden = false;
      }
      return versions.length > 0 || (d.gateway != null && d.gateway.totals.requests + d.gateway.totals.responses_401 +
        d.gateway.totals.responses_429 > 0);
    },
    instance: function (root, d) {
      var ts = d.timestamps;
      draw("chart-requests", ts, [{ label: "requests/s", values: d.requests_per_second }], "", 2);
      draw("chart-cpu", ts, [{ label: "CPU", values: d.cpu_percent }], "%", 1);
      draw("chart-npu", ts, d.devices.map(function (dev) { return { label: dev.name, values: dev.aicore_percent }; }), "%", 1);
      draw("chart-hbm", ts, d.devices.map(function (dev) { return { label: dev.name, values: dev.hbm_used_mb }; }), " MiB", 0);
      draw("chart-scrapes", ts, [{ label: "failed scrapes", values: d.scrape_failures }], "", 0);
      return true;
    },
    fleet: function (root, d) {
      var ts = d.timestamps;
      draw("chart-requests", ts, [{ label: "requests/s", values: d.requests_per_second }], "", 2);
      draw("chart-errors", ts, [{ label: "errors", values: percent(d.error_rate) }], "%", 2);
      drawGateway("chart-gateway", ts, d.gateway);
      if (d.gateway) {
        draw("chart-gateway-time", ts, [{ label: "gateway mean", values: d.gateway.avg_ms }], " ms", 2);
        var summary = root.querySelector(".gateway-totals");
        if (summary) { summary.textContent = gatewayTotals(d.gateway); }
      }
      return d.totals.requests > 0 || (d.gateway != null && d.gateway.totals.requests > 0);
    },
  };

  function follow(root) {
    var status = root.querySelector(".chart-status");
    var toggle = document.querySelector("input[data-refresh]");
    var updated = document.querySelector(".refresh-updated");
    var inflight = false;
    var again = false;

    function url() {
      var params = new URLSearchParams({ range: root.dataset.range });
      if (root.dataset.version) { params.set("version", root.dataset.version); }
      if (root.dataset.deployment) { params.set("deployment", root.dataset.deployment); }
      return root.dataset.api + "?" + params.toString();
    }

    function load() {
      if (inflight) { again = true; return; }  // never two fetches at once; a range switch reloads after
      inflight = true;
      var range = root.dataset.range;
      fetch(url(), { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) {
          if (!response.ok) { throw new Error("the metrics API answered " + response.status); }
          return response.json();
        })
        .then(function (data) {
          if (range !== root.dataset.range) { return; }  // switched meanwhile: the reload below draws it
          var hasData = RENDER[root.dataset.kind](root, data);
          status.textContent = hasData ? "" : "No traffic in this range yet.";
          root.dataset.loaded = "true";
          root.dataset.loads = String(Number(root.dataset.loads || 0) + 1);
          if (updated) { updated.textContent = "updated " + utc(Date.now() / 1000, false) + " UTC"; }
        })
        .catch(function (error) {
          status.textContent = "Could not load the metrics: " + error.message;
          root.dataset.loaded = "error";
        })
        .finally(function () {
          inflight = false;
          if (again) { again = false; load(); }
        });
    }

    // The fleet page's totals and tables are rendered with its range: there the links load the page.
    var links = root.dataset.kind === "fleet" ? [] : document.querySelectorAll(".range-picker a[data-range]");
    links.forEach(function (link) {
      link.addEventListener("click", function (event) {
        event.preventDefault();
        root.dataset.range = link.dataset.range;
        root.dataset.loaded = "false";
        document.querySelectorAll(".range-picker a[data-range]").forEach(function (other) {
          var active = other === link;
          other.classList.toggle("active", active);
          if (active) { other.setAttribute("aria-current", "true"); } else { other.removeAttribute("aria-current"); }
        });
        var address = new URL(window.location.href);
        address.searchParams.set("range", link.dataset.range);
        window.history.replaceState(null, "", address.toString());
        load();
      });
    });

    window.setInterval(function () {
      if (toggle && toggle.checked && !document.hidden) { load(); }
    }, REFRESH_MS);
    if (toggle) {
      toggle.addEventListener("change", function () {
        root.dataset.live = toggle.checked ? "on" : "off";
        if (toggle.checked) { load(); }
      });
      root.dataset.live = toggle.checked ? "on" : "off";
    }
    load();
  }

  window.addEventListener("resize", function () {
    Object.keys(window.metricsCharts).forEach(function (id) {
      var el = document.getElementById(id);
      if (el) { window.metricsCharts[id].setSize({ width: Math.max(el.clientWidth, 240), height: 220 }); }
    });
  });

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll(".metrics[data-api]").forEach(follow);
  });
})();

/* Metrics charts: fetch a metrics endpoint of the REST API and draw it with uPlot.
   Each chart's uPlot instance is kept in window.metricsCharts[<element id>] (the browser test reads it). */
(function () {
  "use strict";

  var PALETTE = ["#1f6feb", "#d1242f", "#1a7f37", "#8250df", "#bf8700", "#0a7ea4", "#cf222e", "#57606a"];
  var DASHES = { p50: [], p95: [6, 4], p99: [2, 3], avg: [] };
  window.metricsCharts = {};

  function fmt(unit, digits) {
    return function (u, v) { return v == null ? "–" : v.toFixed(digits) + unit; };
  }

  function draw(id, timestamps, lines, unit, digits) {
    var el = document.getElementById(id);
    if (!el) { return null; }
    el.textContent = "";
    var series = [{}];
    var data = [timestamps];
    lines.forEach(function (line, i) {
      series.push({
        label: line.label,
        stroke: line.color || PALETTE[i % PALETTE.length],
        dash: line.dash || [],
        width: 2,
        points: { show: false },
        value: fmt(unit, digits),
      });
      data.push(line.values);
    });
    var plot = new uPlot({
      width: Math.max(el.clientWidth, 240),
      height: 220,
      series: series,
      scales: { x: { time: true }, y: { range: function (u, min, max) { return [0, max > 0 ? max * 1.1 : 1]; } } },
      axes: [{}, { size: 72, values: function (u, ticks) { return ticks.map(function (t) { return +t.toFixed(3) + unit; }); } }],
      legend: { live: true },
    }, data, el);
    window.metricsCharts[id] = plot;
    return plot;
  }

  function percent(values) {
    return values.map(function (v) { return v == null ? null : v * 100; });
  }

  var RENDER = {
    model: function (root, d) {
      var ts = d.timestamps;
      var versions = d.versions;
      function perVersion(key, transform) {
        return versions.map(function (v, i) {
          return { label: "v" + v.version, color: PALETTE[i % PALETTE.length], values: transform ? transform(v[key]) : v[key] };
        });
      }
      draw("chart-requests", ts, perVersion("requests_per_second"), "", 2);
      var latency = [];
      versions.forEach(function (v, i) {
        var keys = d.latency === "quantiles" ? ["p50", "p95", "p99"] : ["avg"];
        keys.forEach(function (q) {
          var key = q === "avg" ? "avg_latency_ms" : q + "_ms";
          latency.push({ label: "v" + v.version + " " + q, color: PALETTE[i % PALETTE.length], dash: DASHES[q], values: v[key] });
        });
      });
      root.querySelector(".latency-title").textContent =
        d.latency === "quantiles" ? "Latency p50 / p95 / p99 (ms)" : "Average latency (ms)";
      draw("chart-latency", ts, latency, " ms", 2);
      draw("chart-queue", ts, perVersion("queue_ms"), " ms", 3);
      draw("chart-batch", ts, perVersion("avg_batch_size"), "", 2);
      draw("chart-errors", ts, perVersion("error_rate", percent), "%", 2);
      var totals = root.querySelector(".metric-totals");
      if (totals) {
        var reasons = Object.keys(d.failure_reasons).map(function (k) { return k + " " + d.failure_reasons[k]; }).join(", ");
        totals.textContent = d.totals.requests + " requests, " + d.totals.failure + " failed" +
          (reasons ? " (" + reasons + ")" : "") + " in the last " + d.range + ".";
        totals.hidden = false;
      }
      return versions.length > 0;
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
      return d.totals.requests > 0;
    },
  };

  function load(root) {
    var status = root.querySelector(".chart-status");
    var url = root.dataset.api + "?range=" + encodeURIComponent(root.dataset.range);
    fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) {
        if (!response.ok) { throw new Error("the metrics API answered " + response.status); }
        return response.json();
      })
      .then(function (data) {
        var hasData = RENDER[root.dataset.kind](root, data);
        status.textContent = hasData ? "" : "No traffic in this range yet.";
        root.dataset.loaded = "true";
      })
      .catch(function (error) {
        status.textContent = "Could not load the metrics: " + error.message;
        root.dataset.loaded = "error";
      });
  }

  window.addEventListener("resize", function () {
    Object.keys(window.metricsCharts).forEach(function (id) {
      var el = document.getElementById(id);
      if (el) { window.metricsCharts[id].setSize({ width: Math.max(el.clientWidth, 240), height: 220 }); }
    });
  });

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll(".metrics[data-api]").forEach(load);
  });
})();

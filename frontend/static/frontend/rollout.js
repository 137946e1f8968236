/* Rollout charts on the deployment page: the weight over time and the two versions side by side (requests/s,
   success rate, p50/p99, queue time) from the rollout API's analyses, with the gates drawn as lines. The
   panel around them is an htmx partial that polls itself; the charts element is preserved across swaps and
   refreshed here after each swap (one fetch at a time). uPlot instances: window.rolloutCharts[<name>]. */
(function () {
  "use strict";

  var STABLE = "#1f6feb", CANARY = "#d1242f", GATE = "#57606a", WEIGHT = "#8250df";
  var busy = false;
  window.rolloutCharts = {};

  function pad(n) { return n < 10 ? "0" + n : "" + n; }
  function clock(ts) { var d = new Date(ts * 1000); return pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes()) + ":" + pad(d.getUTCSeconds()); }

  function series(label, color, dash) {
    return { label: label, stroke: color, width: 2, dash: dash || [], spanGaps: true,
             value: function (u, v) { return v == null ? "–" : (+v).toFixed(2); } };
  }

  function gate(label, value) {
    return { label: label, stroke: GATE, width: 1, dash: [5, 5], value: function () { return value == null ? "–" : value; } };
  }

  var CHARTS = [
    { name: "weight", title: "Canary weight (%)", build: function (r, rows) {
        var weight = series("weight %", WEIGHT);
        if (uPlot.paths && uPlot.paths.stepped) { weight.paths = uPlot.paths.stepped({ align: 1 }); }  // steps, not ramps
        return { series: [weight], data: [rows.map(function (a) { return a.weight; })] };
      } },
    { name: "requests", title: "Requests/s", build: function (r, rows) {
        return { series: [series("stable", STABLE), series("canary", CANARY)],
                 data: [pick(rows, "stable", "requests_per_s"), pick(rows, "canary", "requests_per_s")] };
      } },
    { name: "success", title: "Success rate (%)", build: function (r, rows) {
        return { series: [series("stable", STABLE), series("canary", CANARY), gate("gate ≥", r.min_success_rate * 100)],
                 data: [pct(pick(rows, "stable", "success_rate")), pct(pick(rows, "canary", "success_rate")),
                        rows.map(function () { return r.min_success_rate * 100; })] };
      } },
    { name: "latency", title: "Latency p50 / p99 (ms)", build: function (r, rows) {
        var s = [series("stable p50", STABLE, [2, 3]), series("stable p99", STABLE), series("canary p50", CANARY, [2, 3]), series("canary p99", CANARY)];
        var d = [pick(rows, "stable", "p50_ms"), pick(rows, "stable", "p99_ms"), pick(rows, "canary", "p50_ms"), pick(rows, "canary", "p99_ms")];
        if (r.max_p99_ms != null) { s.push(gate("p99 gate ≤", r.max_p99_ms)); d.push(rows.map(function () { return r.max_p99_ms; })); }
        if (r.max_p99_ratio != null) {
          s.push(gate("ratio gate ≤", r.max_p99_ratio + "× stable"));
          d.push(rows.map(function (a) { var v = (a.figures.stable || {}).p99_ms; return v == null ? null : v * r.max_p99_ratio; }));
        }
        return { series: s, data: d };
      } },
    { name: "queue", title: "Queue time, mean (ms)", build: function (r, rows) {
        return { series: [series("stable", STABLE), series("canary", CANARY)],
                 data: [pick(rows, "stable", "queue_ms"), pick(rows, "canary", "queue_ms")] };
      } }
  ];

  function pick(rows, role, key) { return rows.map(function (a) { var f = a.figures[role] || {}; return f[key] == null ? null : f[key]; }); }
  function pct(values) { return values.map(function (v) { return v == null ? null : v * 100; }); }

  function draw(holder, rollout) {
    var rows = (rollout.analyses || []).filter(function (a) { return !a.waiting; });
    var xs = rows.map(function (a) { return Date.parse(a.checked_at) / 1000; });
    CHARTS.forEach(function (chart) {
      var built = chart.build(rollout, rows);
      var data = [xs].concat(built.data);
      var existing = window.rolloutCharts[chart.name];
      if (existing && existing.series.length === built.series.length + 1) { existing.setData(data); return; }
      if (existing) { existing.destroy(); }
      var box = holder.querySelector('[data-chart="' + chart.name + '"]');
      if (!box) {
        box = document.createElement("figure");
        box.className = "chart rollout-chart";
        box.dataset.chart = chart.name;
        box.innerHTML = "<figcaption></figcaption>";
        box.querySelector("figcaption").textContent = chart.title;
        holder.appendChild(box);
      }
      window.rolloutCharts[chart.name] = new uPlot({
        width: Math.max(260, Math.min(520, holder.clientWidth / 2 - 16)), height: 180,
        scales: { x: { time: true } },
        axes: [{ values: function (u, splits) { return splits.map(clock); } }, {}],
        series: [{ label: "UTC", value: function (u, v) { return v == null ? "–" : clock(v); } }].concat(built.series)
      }, data, box);
    });
    holder.dataset.analyses = rows.length;
  }

  function refresh() {
    var panel = document.getElementById("rollout-panel");
    var holder = document.getElementById("rollout-charts");
    if (!panel || !holder || !panel.dataset.api || busy || typeof uPlot === "undefined") { return; }
    if (holder.dataset.rollout && holder.dataset.rollout !== panel.dataset.rollout) {
      holder.textContent = "";
      Object.keys(window.rolloutCharts).forEach(function (k) { window.rolloutCharts[k].destroy(); delete window.rolloutCharts[k]; });
    }
    holder.dataset.rollout = panel.dataset.rollout;
    busy = true;
    fetch(panel.dataset.api, { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (rollout) { if (rollout) { draw(holder, rollout); } })
      .finally(function () { busy = false; });
  }

  document.addEventListener("DOMContentLoaded", refresh);
  document.addEventListener("htmx:afterSettle", function (e) {
    // With an outerHTML swap the event may come from the new panel or from the swapped-out one's parent.
    var t = e.target;
    if (t && (t.id === "rollout-panel" || (t.closest && t.closest("#rollout-panel")) || (t.querySelector && t.querySelector(":scope > #rollout-panel")))) { refresh(); }
  });
})();

/* Operations dashboard: keeps the figures, tables and chart of /admin/dashboard/ current.
 *
 * The page carries its first snapshot (#dashboard-snapshot). The snapshot is read again from
 * #dashboard[data-url] when live events arrive (live.js dispatches an "orchestrator:event" per
 * event), at most once per data-min-interval-ms, and every data-refresh-ms in any case; between
 * reads, ages ([data-age-s]) tick every second. Nothing reloads the page.
 *
 * Hooks for scripts and tests:
 *   [data-metric="<name>"]              text and data-value ← snapshot.metrics[name]
 *   [data-tile][data-alert]             .is-alert while the figure is nonzero / zero
 *   tbody[data-table="<name>"]          rows rebuilt from the snapshot (lanes, types, executing,
 *                                       stuck, workers, job-failures, run-failures, escalations, credits)
 *   #dashboard[data-updated-at]         the snapshot's time; data-refreshes counts the reads
 *   #dashboard-chart svg [data-series]  one per series, with data-total
 * After each read the document receives an "orchestrator:dashboard-updated" event.
 */
(function () {
  "use strict";
  var root = document.getElementById("dashboard");
  if (!root) { return; }
  var SVG = "http://www.w3.org/2000/svg";
  var url = root.getAttribute("data-url");
  var refreshMs = parseInt(root.getAttribute("data-refresh-ms"), 10) || 10000;
  var minIntervalMs = parseInt(root.getAttribute("data-min-interval-ms"), 10) || 1000;
  var statusLine = document.getElementById("dashboard-status");
  var readAt = Date.now();
  var timer = null;
  var inFlight = false;
  var again = false;
  var lastStart = 0;
  var refreshes = 0;

  // --- small DOM helpers ------------------------------------------------------------------
  function node(tag, attrs, children) {
    var element = document.createElement(tag);
    setAttrs(element, attrs);
    append(element, children);
    return element;
  }

  function setAttrs(element, attrs) {
    for (var name in attrs || {}) {
      if (Object.prototype.hasOwnProperty.call(attrs, name) && attrs[name] !== null && attrs[name] !== undefined) {
        element.setAttribute(name, String(attrs[name]));
      }
    }
  }

  function append(element, children) {
    if (children === null || children === undefined) { return; }
    if (!Array.isArray(children)) { children = [children]; }
    for (var i = 0; i < children.length; i++) {
      var child = children[i];
      if (child === null || child === undefined) { continue; }
      element.appendChild(typeof child === "object" ? child : document.createTextNode(String(child)));
    }
  }

  function link(href, text) {
    return href ? node("a", {href: href}, text) : String(text);
  }

  function svg(tag, attrs, children) {
    var element = document.createElementNS(SVG, tag);
    setAttrs(element, attrs);
    append(element, children);
    return element;
  }

  function formatAge(seconds) {
    if (seconds === null || seconds === undefined || isNaN(seconds)) { return "—"; }
    var s = Math.max(0, Math.round(seconds));
    if (s < 120) { return s + " s"; }
    var minutes = Math.floor(s / 60);
    if (minutes < 120) { return minutes + " min"; }
    return Math.floor(minutes / 60) + " h " + (minutes % 60) + " min";
  }

  // A cell whose age keeps ticking: data-age-s is the age when the snapshot was read.
  function age(seconds, attrs, direction) {
    var cellAttrs = attrs || {};
    cellAttrs["data-age-s"] = seconds === null || seconds === undefined ? "" : seconds;
    if (direction) { cellAttrs["data-age-direction"] = direction; }
    return {attrs: cellAttrs, content: formatAge(seconds)};
  }

  function tick() {
    var elapsed = (Date.now() - readAt) / 1000;
    var cells = root.querySelectorAll("[data-age-s]");
    for (var i = 0; i < cells.length; i++) {
      var raw = cells[i].getAttribute("data-age-s");
      if (raw === "") { continue; }
      var base = parseFloat(raw);
      var down = cells[i].getAttribute("data-age-direction") === "down";
      var value = down ? base - elapsed : base + elapsed;
      cells[i].textContent = down && value < 0 ? "expired " + formatAge(-value) + " ago" : formatAge(value);
    }
  }

  // --- figures ----------------------------------------------------------------------------
  function renderMetrics(snapshot) {
    var metrics = snapshot.metrics || {};
    var bounded = snapshot.bounded || [];  // figures that reached the dashboard's count limit: "1000+"
    var figures = root.querySelectorAll("[data-metric]");
    for (var i = 0; i < figures.length; i++) {
      var name = figures[i].getAttribute("data-metric");
      if (!Object.prototype.hasOwnProperty.call(metrics, name)) { continue; }
      var value = String(metrics[name]) + (bounded.indexOf(name) >= 0 ? "+" : "");
      if (figures[i].textContent !== value) {
        figures[i].textContent = value;
        figures[i].classList.add("live-flash");
        (function (figure) { setTimeout(function () { figure.classList.remove("live-flash"); }, 1200); })(figures[i]);
      }
      figures[i].setAttribute("data-value", value);
    }
    var tiles = root.querySelectorAll("[data-tile]");
    for (var j = 0; j < tiles.length; j++) {
      var metric = tiles[j].getAttribute("data-tile");
      var rule = tiles[j].getAttribute("data-alert");
      var number = Number(metrics[metric] || 0);
      tiles[j].classList.toggle("is-alert", (rule === "nonzero" && number !== 0) || (rule === "zero" && number === 0));
      if (snapshot.links && snapshot.links[metric]) { tiles[j].setAttribute("href", snapshot.links[metric]); }
    }
  }

  // --- tables -----------------------------------------------------------------------------
  var TABLES = {
    lanes: {
      rows: function (s) { return s.queue.by_lane; }, empty: "No job waiting or executing.",
      row: function (r) {
        return {attrs: {"data-lane": r.key}, cells: [
          link(r.url, r.key || "(no lane)"), {attrs: {"data-metric": "lane-waiting"}, content: r.waiting},
          r.delayed, r.executing, age(r.oldest_waiting_s)]};
      }
    },
    types: {
      rows: function (s) { return s.queue.by_type; }, empty: "No job waiting or executing.",
      row: function (r) {
        return {attrs: {"data-type": r.key}, cells: [
          link(r.url, r.key), {attrs: {"data-metric": "type-waiting"}, content: r.waiting},
          r.delayed, r.executing, age(r.oldest_waiting_s)]};
      }
    },
    executing: {
      rows: function (s) { return s.queue.executing_jobs; }, empty: "No job executing.",
      row: function (r) {
        return {attrs: {"data-job": r.id}, cells: [
          link(r.url, r.id), r.type, r.lane, r.run ? link(r.run_url, r.run) : "", r.worker, r.attempt,
          age(r.age_s, {"data-metric": "job-age"}), age(r.lease_left_s, null, "down")]};
      }
    },
    stuck: {
      rows: function (s) { return s.runs.stuck; }, empty: "No stuck run.",
      row: function (r) {
        var heartbeat = r.heartbeat_age_s === null ? "never" : age(r.heartbeat_age_s);
        return {attrs: {"data-run": r.id}, cells: [
          link(r.url, r.id + " " + r.name), r.status + (r.status_reason ? " " + r.status_reason : ""),
          age(r.in_status_s), heartbeat]};
      }
    },
    workers: {
      rows: function (s) { return s.queue.workers; }, empty: "No worker has been seen.",
      row: function (r) {
        var state = r.alive ? "alive" : "stale";
        return {attrs: {"data-worker": r.worker, "data-alive": r.alive ? "true" : "false"}, cells: [
          r.worker, node("span", {"class": "status-badge", "data-value": state}, state), age(r.last_seen_s),
          r.current_job === null ? "" : r.current_job, r.jobs_done]};
      }
    },
    "job-failures": {
      rows: function (s) { return s.failures.jobs_by_reason; }, empty: "No job failed.",
      row: function (r) {
        return {attrs: {"data-reason": r.reason}, cells: [
          link(r.url, r.reason || "(none)"), {attrs: {"data-metric": "job-failures"}, content: r.count}]};
      }
    },
    "run-failures": {
      rows: function (s) { return s.failures.runs_by_code; }, empty: "No run failed.",
      row: function (r) {
        return {attrs: {"data-code": r.code}, cells: [
          link(r.url, r.code || "(none)"), {attrs: {"data-metric": "run-failures"}, content: r.count}]};
      }
    },
    escalations: {
      rows: function (s) { return s.escalations.latest; }, empty: "No open escalation.",
      row: function (r) {
        return {attrs: {"data-escalation": r.id}, cells: [
          link(r.url, r.id), link(r.run_url, r.run), r.trigger, r.severity, r.status]};
      }
    },
    credits: {
      rows: function (s) { return s.credits.top; }, empty: "No credits reserved.",
      row: function (r) {
        return {attrs: {"data-organization": r.organization_id}, cells: [
          link(r.url, r.organization), r.reserved, r.available]};
      }
    }
  };

  function renderTables(snapshot) {
    var bodies = root.querySelectorAll("tbody[data-table]");
    for (var i = 0; i < bodies.length; i++) {
      var spec = TABLES[bodies[i].getAttribute("data-table")];
      if (!spec) { continue; }
      var columns = bodies[i].parentNode.querySelectorAll("thead th").length || 1;
      var rows = spec.rows(snapshot) || [];
      var fragment = document.createDocumentFragment();
      if (!rows.length) {
        fragment.appendChild(node("tr", {"class": "dashboard-empty"}, node("td", {colspan: columns}, spec.empty)));
      }
      for (var j = 0; j < rows.length; j++) {
        var row = spec.row(rows[j]);
        var tr = node("tr", row.attrs);
        for (var k = 0; k < row.cells.length; k++) {
          var cell = row.cells[k];
          var isSpec = cell !== null && typeof cell === "object" && !(cell instanceof Node);
          tr.appendChild(node("td", isSpec ? cell.attrs : null, isSpec ? cell.content : cell));
        }
        fragment.appendChild(tr);
      }
      bodies[i].textContent = "";
      bodies[i].appendChild(fragment);
    }
    var more = root.querySelectorAll("[data-more]");
    for (var m = 0; m < more.length; m++) {
      var kind = more[m].getAttribute("data-more");
      var shown = (kind === "lanes" ? snapshot.queue.by_lane : snapshot.queue.by_type).length;
      var total = kind === "lanes" ? snapshot.queue.lanes_total : snapshot.queue.types_total;
      more[m].setAttribute("data-shown", shown);
      more[m].setAttribute("data-total", total);
      more[m].textContent = total > shown ? "The " + shown + " deepest of " + total + " are shown." : "";
    }
  }

  // --- chart: jobs and runs completed (lines) and failures (bars) per minute -------------------
  var SERIES = [
    {name: "jobs_completed", label: "jobs completed", kind: "line"},
    {name: "runs_completed", label: "runs completed", kind: "line"},
    {name: "failures", label: "failures", kind: "bars"}
  ];

  function niceMax(value) {
    if (value <= 5) { return 5; }
    var power = Math.pow(10, Math.floor(Math.log(value) / Math.LN10));
    var steps = [1, 2, 5, 10];
    for (var i = 0; i < steps.length; i++) {
      if (steps[i] * power >= value) { return steps[i] * power; }
    }
    return 10 * power;
  }

  function clock(ms) {
    var date = new Date(ms);
    return ("0" + date.getHours()).slice(-2) + ":" + ("0" + date.getMinutes()).slice(-2);
  }

  var lastChart = null;

  function drawChart(chart) {
    lastChart = chart;
    var figure = document.getElementById("dashboard-chart");
    if (!figure || !chart || !chart.series) { return; }
    var width = Math.max(320, Math.round(figure.clientWidth || 720)), height = 200;
    var left = 40, right = 12, top = 10, bottom = 24;
    var count = chart.buckets || 60;
    var plotWidth = width - left - right, plotHeight = height - top - bottom;
    var step = plotWidth / count;
    var start = Date.parse(chart.start);
    var peak = 0;
    for (var s = 0; s < SERIES.length; s++) {
      var values = chart.series[SERIES[s].name] || [];
      for (var v = 0; v < values.length; v++) { peak = Math.max(peak, values[v]); }
    }
    var max = niceMax(peak);
    function x(i) { return left + step * (i + 0.5); }
    function y(value) { return top + plotHeight * (1 - value / max); }
    var drawing = svg("svg", {viewBox: "0 0 " + width + " " + height, role: "img",
                              "class": "dashboard-chart-svg", "data-max": max, "data-start": chart.start,
                              "aria-label": "per minute over the last hour, peak " + peak});
    [0, max / 2, max].forEach(function (tickValue) {
      drawing.appendChild(svg("line", {x1: left, x2: width - right, y1: y(tickValue), y2: y(tickValue),
                                       "class": "chart-grid"}));
      drawing.appendChild(svg("text", {x: left - 6, y: y(tickValue) + 4, "text-anchor": "end", "class": "chart-label"},
                              Number.isInteger(tickValue) ? String(tickValue) : tickValue.toFixed(1)));
    });
    [[0, "−60 min"], [Math.floor(count / 2), "−30 min"], [count - 1, "now"]].forEach(function (mark) {
      drawing.appendChild(svg("text", {x: x(mark[0]), y: height - 6, "text-anchor": "middle", "class": "chart-label"},
                              mark[1]));
    });
    SERIES.forEach(function (series) {
      var values = chart.series[series.name] || [];
      var total = (chart.totals && chart.totals[series.name]) || 0;
      if (series.kind === "bars") {
        var group = svg("g", {"data-series": series.name, "data-total": total, "class": "chart-" + series.name});
        for (var i = 0; i < values.length; i++) {
          if (!values[i]) { continue; }
          group.appendChild(svg("rect", {x: x(i) - step * 0.35, width: step * 0.7, y: y(values[i]),
                                         height: Math.max(1, plotHeight * values[i] / max)}));
        }
        drawing.appendChild(group);
      } else {
        var points = [];
        for (var j = 0; j < values.length; j++) { points.push(x(j).toFixed(1) + "," + y(values[j]).toFixed(1)); }
        drawing.appendChild(svg("polyline", {points: points.join(" "), "data-series": series.name,
                                             "data-total": total, "class": "chart-" + series.name}));
      }
    });
    var hover = svg("g", {"class": "chart-hover"});
    for (var k = 0; k < count; k++) {
      var parts = [];
      for (var n = 0; n < SERIES.length; n++) {
        parts.push(SERIES[n].label + " " + ((chart.series[SERIES[n].name] || [])[k] || 0));
      }
      hover.appendChild(svg("rect", {x: left + step * k, y: top, width: step, height: plotHeight},
                            svg("title", null, clock(start + k * 60000) + " — " + parts.join(", "))));
    }
    drawing.appendChild(hover);
    var previous = figure.querySelector("svg");
    if (previous) { figure.replaceChild(drawing, previous); } else { figure.appendChild(drawing); }
  }

  // --- reading the snapshot ------------------------------------------------------------------
  function showStatus(state, text) {
    if (!statusLine) { return; }
    statusLine.className = "dashboard-status dashboard-status-" + state;
    statusLine.textContent = text;
  }

  function render(snapshot) {
    readAt = Date.now();
    renderMetrics(snapshot);
    renderTables(snapshot);
    drawChart(snapshot.chart);
    tick();
    root.setAttribute("data-updated-at", snapshot.at);
    root.setAttribute("data-refreshes", String(refreshes));
    showStatus("ok", "Updated " + new Date(Date.parse(snapshot.at)).toLocaleTimeString() +
                     "; refreshed on every event (at most once a second) and every " + Math.round(refreshMs / 1000) + " s.");
    document.dispatchEvent(new CustomEvent("orchestrator:dashboard-updated", {detail: {at: snapshot.at}}));
  }

  function load() {
    inFlight = true;
    lastStart = Date.now();
    fetch(url, {credentials: "same-origin", cache: "no-store", headers: {"Accept": "application/json"}})
      .then(function (response) {
        return response.json().catch(function () { return {}; }).then(function (body) {
          if (!response.ok) { throw new Error(body.detail || "HTTP " + response.status); }
          return body;
        });
      })
      .then(function (snapshot) { refreshes += 1; render(snapshot); })
      .catch(function (error) { showStatus("error", "Could not refresh: " + error.message + ". Retrying."); })
      .then(function () {
        inFlight = false;
        if (again) { again = false; schedule(); }
      });
  }

  // At most one read in flight and one read per minIntervalMs; events during a read ask for one more.
  function schedule() {
    if (inFlight) { again = true; return; }
    if (timer !== null) { return; }
    var wait = Math.max(0, lastStart + minIntervalMs - Date.now());
    timer = setTimeout(function () { timer = null; load(); }, wait);
  }

  var initial = document.getElementById("dashboard-snapshot");
  if (initial) {
    try {
      var snapshot = JSON.parse(initial.textContent);
      drawChart(snapshot.chart);
      renderTables(snapshot);
      tick();
    } catch (error) {
      showStatus("error", "Could not read the first snapshot; waiting for the next one.");
    }
  }
  window.addEventListener("resize", function () { if (lastChart) { drawChart(lastChart); } });
  document.addEventListener("orchestrator:event", schedule);
  setInterval(schedule, refreshMs);
  setInterval(tick, 1000);
})();

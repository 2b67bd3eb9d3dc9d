/* The run page's Gantt chart of step tries (runs/admin_run_page.py).
 *
 * Reads <id>/timeline/ (the same pages as GET /api/v1/runs/{id}/timeline/, following `next` up
 * to MAX_TRIES tries) and draws an SVG: a lane per step, grouped by run attempt, agent and task,
 * a bar per try placed by its start and finish (a try still running reaches "now"), coloured by
 * its status, with a tooltip of its details. Events of this run (core's live.js dispatches each
 * as an "orchestrator:event" DOM event) fetch it again, at most once per THROTTLE_MS.
 */
(function () {
  "use strict";
  var box = document.getElementById("run-gantt");
  if (!box || !window.fetch) { return; }
  var runId = parseInt(box.getAttribute("data-run"), 10);
  var url = box.getAttribute("data-timeline-url");
  var SVG = "http://www.w3.org/2000/svg";
  var MAX_TRIES = 5000;
  var THROTTLE_MS = 1000;
  var LABEL_W = 230, LANE_H = 18, GROUP_H = 20, AXIS_H = 22, BAR_PAD = 3, MIN_BAR = 3;
  var STATUSES = ["succeeded", "failed", "running", "discarded"];
  var loading = false, again = false, lastLoad = 0, timer = null, data = null;

  function el(name, attrs, text) {
    var node = document.createElementNS(SVG, name);
    for (var key in attrs) { if (Object.prototype.hasOwnProperty.call(attrs, key)) { node.setAttribute(key, attrs[key]); } }
    if (text !== undefined) { node.textContent = text; }
    return node;
  }

  function ms(value) { return value ? Date.parse(value) : null; }

  function seconds(value) {
    if (value < 1000) { return Math.round(value) + " ms"; }
    if (value < 120000) { return (value / 1000).toFixed(value < 10000 ? 1 : 0) + " s"; }
    return Math.round(value / 60000) + " min";
  }

  function clip(text, size) { return text.length > size ? text.slice(0, size - 1) + "…" : text; }

  function groups(items) {
    // attempt → agent → task, each group's lanes (steps) in order of their first try.
    var byKey = {}, order = [];
    items.forEach(function (item) {
      var key = item.attempt + ":" + item.agent.id + ":" + item.task.id;
      var group = byKey[key];
      if (!group) {
        group = byKey[key] = {attempt: item.attempt, agent: item.agent, task: item.task, lanes: {}, laneOrder: []};
        order.push(group);
      }
      var lane = group.lanes[item.step.id];
      if (!lane) {
        lane = group.lanes[item.step.id] = {step: item.step, tries: []};
        group.laneOrder.push(lane);
      }
      lane.tries.push(item);
    });
    order.sort(function (a, b) { return a.attempt - b.attempt; });  // stable: first try order within an attempt
    return order;
  }

  function tooltip(item, end) {
    var lines = ["step " + item.step.name + " (" + (item.step.tool || item.step.kind) + ")",
      "agent " + item.agent.name + " → task " + item.task.name,
      "attempt " + item.attempt + ", try " + item["try"] + ": " + item.status,
      "started " + item.started_at.replace("T", " ").slice(0, 23),
      item.finished_at ? "finished " + item.finished_at.replace("T", " ").slice(0, 23) + " (" + seconds(item.duration_ms) + ")"
        : "running for " + seconds(end - ms(item.started_at)),
      "credits " + item.credits];
    if (item.error_code) { lines.push("error " + item.error_code + (item.retryable ? " (retryable)" : "")); }
    return lines.join("\n");
  }

  function draw() {
    var items = data.items;
    box.textContent = "";
    var legend = document.createElement("p");
    legend.className = "run-gantt-legend";
    var note = items.length + " step tr" + (items.length === 1 ? "y" : "ies");
    if (data.count > items.length) { note = "the first " + items.length + " of " + data.count + " step tries"; }
    legend.appendChild(document.createTextNode(note + " · run " + data.status));
    STATUSES.forEach(function (status) {
      var swatch = document.createElement("span");
      swatch.className = "swatch gantt-" + status;
      legend.appendChild(swatch);
      legend.appendChild(document.createTextNode(status));
    });
    box.appendChild(legend);
    if (!items.length) {
      var none = document.createElement("p");
      none.className = "help run-gantt-empty";
      none.textContent = "no step has been tried yet";
      box.appendChild(none);
      return;
    }
    var now = ms(data.generated_at) || Date.now();
    var start = Infinity, end = -Infinity;
    items.forEach(function (item) {
      start = Math.min(start, ms(item.started_at));
      end = Math.max(end, item.finished_at ? ms(item.finished_at) : now);
    });
    if (end - start < 1000) { end = start + 1000; }
    var list = groups(items);
    var height = AXIS_H;
    list.forEach(function (group) { height += GROUP_H + group.laneOrder.length * LANE_H; });
    var width = Math.max(box.clientWidth || 900, 500);
    var plotW = width - LABEL_W - 10;
    var x = function (t) { return LABEL_W + (t - start) / (end - start) * plotW; };
    var svg = el("svg", {width: width, height: height + 4, viewBox: "0 0 " + width + " " + (height + 4),
      "class": "gantt", role: "img", "aria-label": "step tries of run " + runId});
    var axis = el("g", {"class": "gantt-axis"});
    for (var tick = 0; tick <= 5; tick++) {
      var t = start + (end - start) * tick / 5, tx = x(t);
      axis.appendChild(el("line", {x1: tx, x2: tx, y1: AXIS_H - 4, y2: height}));
      axis.appendChild(el("text", {x: tx, y: 12, "text-anchor": tick === 0 ? "start" : (tick === 5 ? "end" : "middle")},
        "+" + seconds(t - start)));
    }
    svg.appendChild(axis);
    var y = AXIS_H;
    list.forEach(function (group) {
      var head = el("g", {"class": "gantt-group-row"});
      head.appendChild(el("text", {"class": "gantt-group", x: 2, y: y + 14},
        clip("attempt " + group.attempt + " · " + group.agent.name + " → " + group.task.name, 60)));
      svg.appendChild(head);
      y += GROUP_H;
      var lanes = el("g", {"class": "gantt-lanes"});
      group.laneOrder.forEach(function (lane) {
        var row = el("g", {"class": "gantt-lane", "data-step": lane.step.id});
        row.appendChild(el("rect", {"class": "gantt-lane-bg", x: 0, y: y, width: width, height: LANE_H}));
        row.appendChild(el("text", {"class": "gantt-lane-label", x: 14, y: y + 13}, clip(lane.step.name, 32)));
        lane.tries.forEach(function (item) {
          var x1 = x(ms(item.started_at));
          var x2 = x(item.finished_at ? ms(item.finished_at) : now);
          var bar = el("rect", {"class": "gantt-bar gantt-" + item.status, x: x1, y: y + BAR_PAD,
            width: Math.max(MIN_BAR, x2 - x1), height: LANE_H - 2 * BAR_PAD, rx: 2,
            "data-try": item.id, "data-status": item.status, "data-step": item.step.id});
          bar.appendChild(el("title", {}, tooltip(item, now)));
          row.appendChild(bar);
        });
        lanes.appendChild(row);
        y += LANE_H;
      });
      svg.appendChild(lanes);
    });
    box.appendChild(svg);
    box.setAttribute("data-tries", String(items.length));
    box.setAttribute("data-loaded", String(Date.now()));
  }

  function summarize(page) {
    // The summary's credits follow the run (its status and reason follow the events in live.js).
    var credits = page.credits;
    if (!credits) { return; }
    var values = {charged: credits.charged, reserved: credits.reserved, refunded: credits.refunded,
      held: credits.reserved - credits.charged - credits.refunded};
    Object.keys(values).forEach(function (name) {
      var node = document.querySelector('#run-summary [data-credits="' + name + '"]');
      if (node && node.textContent !== String(values[name])) { node.textContent = String(values[name]); }
    });
  }

  function fail(message) {
    box.textContent = "";
    var p = document.createElement("p");
    p.className = "errornote run-gantt-error";
    p.textContent = "the timeline could not be read: " + message;
    box.appendChild(p);
  }

  function load() {
    if (loading) { again = true; return; }
    loading = true;
    lastLoad = Date.now();
    var page = {items: []};
    function next(link) {
      return fetch(link, {credentials: "same-origin", headers: {Accept: "application/json"}})
        .then(function (response) {
          if (!response.ok) { throw new Error("HTTP " + response.status); }
          return response.json();
        })
        .then(function (body) {
          page.items = page.items.concat(body.items);
          page.count = body.count; page.status = body.status; page.generated_at = body.generated_at;
          page.credits = body.credits;
          if (body.next && page.items.length < MAX_TRIES) { return next(body.next); }
          return page;
        });
    }
    next(url).then(function (result) { data = result; draw(); summarize(result); }, function (error) { fail(error.message); })
      .then(function () {
        loading = false;
        if (again) { again = false; schedule(); }
      });
  }

  function schedule() {
    if (timer) { return; }
    var wait = Math.max(0, THROTTLE_MS - (Date.now() - lastLoad));
    timer = setTimeout(function () { timer = null; load(); }, wait);
  }

  document.addEventListener("orchestrator:event", function (event) {
    var detail = event.detail || {};
    if (detail.run !== runId || typeof detail.type !== "string") { return; }
    if (/^(step|task|agent|run)_/.test(detail.type)) { schedule(); }
  });
  var resized = null;
  window.addEventListener("resize", function () {
    if (!data) { return; }
    clearTimeout(resized);
    resized = setTimeout(draw, 200);
  });
  load();
})();

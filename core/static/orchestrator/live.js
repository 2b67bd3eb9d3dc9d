/* Live admin: follows /ws/events/ and updates marked elements in place.
 *
 * Elements opt in with data attributes:
 *   data-live="run-status" data-run="<id>"        text ← the run's state
 *   data-live="job-state"  data-job="<id>"        text ← the job's state
 *   data-live="heartbeat"  data-run="<id>"        "<n> s ago", refreshed every second
 *   data-live="counter"    data-event="<type>"    incremented for each event of that type
 * The banner shows "live", "reconnecting…" or "replaying…"; on reconnect the page asks for
 * everything after the last event id it saw, so nothing is missed while the socket was down.
 */
(function () {
  "use strict";
  var body = document.body;
  if (!body || !window.WebSocket) { return; }
  var scopeNode = document.querySelector("[data-live-scope-run]");
  var scopeRun = scopeNode ? scopeNode.getAttribute("data-live-scope-run") : null;
  var lastId = null;
  var retry = 500;
  var banner = document.createElement("div");
  banner.id = "live-banner";
  banner.setAttribute("role", "status");
  document.body.appendChild(banner);

  function show(state, text) {
    banner.className = "live-" + state;
    banner.textContent = text;
  }

  function setText(selector, value) {
    var nodes = document.querySelectorAll(selector);
    for (var i = 0; i < nodes.length; i++) {
      if (nodes[i].textContent !== value) {
        nodes[i].textContent = value;
        nodes[i].setAttribute("data-value", value);
        nodes[i].classList.add("live-flash");
        (function (node) { setTimeout(function () { node.classList.remove("live-flash"); }, 1200); })(nodes[i]);
      }
    }
  }

  function apply(event) {
    if (typeof event.id === "number") { lastId = event.id; }
    if (event.type && event.type.indexOf("run_") === 0 && event.run && event.to) {
      setText('[data-live="run-status"][data-run="' + event.run + '"]', event.to);
      if (event.status_reason !== undefined) {
        setText('[data-live="run-reason"][data-run="' + event.run + '"]', event.status_reason || "");
      }
    }
    if (event.type && event.type.indexOf("orchestrator_job_") === 0 && event.jobId) {
      setText('[data-live="job-state"][data-job="' + event.jobId + '"]', event.state);
    }
    if (event.run && (event.type.indexOf("step_") === 0 || event.type.indexOf("run_") === 0)) {
      var beats = document.querySelectorAll('[data-live="heartbeat"][data-run="' + event.run + '"]');
      for (var i = 0; i < beats.length; i++) { beats[i].setAttribute("data-ts", event.ts); }
    }
    var counters = document.querySelectorAll('[data-live="counter"][data-event="' + event.type + '"]');
    for (var j = 0; j < counters.length; j++) {
      counters[j].textContent = String(parseInt(counters[j].textContent || "0", 10) + 1);
    }
    document.dispatchEvent(new CustomEvent("orchestrator:event", {detail: event}));
  }

  setInterval(function () {
    var beats = document.querySelectorAll('[data-live="heartbeat"][data-ts]');
    for (var i = 0; i < beats.length; i++) {
      var age = Math.max(0, Math.round((Date.now() - Date.parse(beats[i].getAttribute("data-ts"))) / 1000));
      beats[i].textContent = age + " s ago";
    }
  }, 1000);

  function connect() {
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    var socket = new WebSocket(scheme + window.location.host + "/ws/events/");
    var replayUntil = null;
    socket.onopen = function () { show("connecting", "connecting…"); };
    socket.onmessage = function (message) {
      var data = JSON.parse(message.data);
      if (data.type === "hello") {
        retry = 500;
        var subscribe = scopeRun ? {action: "subscribe", run: parseInt(scopeRun, 10)} : {action: "subscribe", all: true};
        if (lastId !== null) { subscribe.after = lastId; }
        socket.send(JSON.stringify(subscribe));
        return;
      }
      if (data.type === "subscribed") {
        if (lastId !== null && data.cursor > lastId) {
          replayUntil = data.cursor;
          show("replaying", "replaying " + (data.cursor - lastId) + " missed events…");
        } else {
          show("live", "live");
        }
        if (lastId === null) { lastId = data.cursor; }
        return;
      }
      if (data.type === "error") { show("error", "live updates unavailable: " + data.detail); return; }
      if (typeof data.id === "number") {
        apply(data);
        if (replayUntil !== null && data.id >= replayUntil) { replayUntil = null; show("live", "live"); }
      }
    };
    socket.onclose = function () {
      show("reconnecting", "connection lost — reconnecting…");
      setTimeout(connect, retry);
      retry = Math.min(retry * 2, 10000);
    };
  }
  connect();
})();

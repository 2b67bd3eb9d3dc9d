/* The run page's diagnosis panel, kept current by the live events (core's live.js dispatches
 * each one as an "orchestrator:event" DOM event):
 *   diagnosis_explanation  the explanation row under its stable id is replaced in place (or
 *                          added after its failure row at the end of the timeline);
 *   diagnosis_suggestion   the suggested next action is shown;
 *   run_* and step_*       the run changed: a shown suggestion is marked stale.
 */
(function () {
  "use strict";
  var panel = document.querySelector("[data-diagnosis-run]");
  if (!panel) { return; }
  var runId = parseInt(panel.getAttribute("data-diagnosis-run"), 10);
  var labels = {explaining: "Explaining…", final: "Explained", summary: "Not explained"};

  function cell(text, className) {
    var td = document.createElement("td");
    if (className) { td.className = className; }
    td.textContent = text;
    return td;
  }

  function badge(status) {
    var span = document.createElement("span");
    span.className = "status-badge";
    span.setAttribute("data-value", status);
    span.textContent = labels[status] || status;
    return span;
  }

  function fillExplanation(row, explanation) {
    row.setAttribute("data-status", explanation.status);
    row.textContent = "";
    var first = document.createElement("td");
    first.appendChild(badge(explanation.status));
    row.appendChild(first);
    row.appendChild(cell(explanation.text || "explaining…", "diagnosis-explanation-text"));
    row.classList.add("live-flash");
    setTimeout(function () { row.classList.remove("live-flash"); }, 1200);
  }

  function upsertExplanation(event) {
    var explanation = event.explanation;
    var row = document.getElementById(explanation.id);
    if (!row) {
      var body = panel.querySelector(".diagnosis-timeline tbody");
      var empty = body.querySelector(".diagnosis-empty");
      if (empty) { empty.parentNode.removeChild(empty); }
      var failure = document.createElement("tr");
      failure.className = "diagnosis-failure";
      failure.setAttribute("data-failure", explanation.id);
      failure.appendChild(cell(event.ts ? event.ts.replace("T", " ").slice(0, 19) : ""));
      failure.appendChild(cell(event.failure || ("attempt " + explanation.attempt + " failed: " + explanation.error_code)));
      row = document.createElement("tr");
      row.className = "diagnosis-explanation";
      row.id = explanation.id;
      body.appendChild(failure);
      body.appendChild(row);
    }
    fillExplanation(row, explanation);
  }

  function showSuggestion(suggestion) {
    var box = panel.querySelector(".diagnosis-suggestion");
    box.setAttribute("data-suggestion", suggestion.id);
    box.setAttribute("data-status", suggestion.status);
    var status = box.querySelector(".diagnosis-suggestion-status");
    status.textContent = suggestion.status;
    status.setAttribute("data-value", suggestion.status);
    box.querySelector(".diagnosis-suggestion-text").textContent =
      suggestion.text || ("working on it (job " + suggestion.job + ")…");
    box.querySelector(".diagnosis-suggestion-asked").textContent =
      "asked by " + (suggestion.requested_by || "system") + " at " + suggestion.requested_at +
      ", when the run was " + suggestion.run_status_at_request;
    markStale(suggestion.stale, suggestion.run_status);
    box.classList.add("live-flash");
    setTimeout(function () { box.classList.remove("live-flash"); }, 1200);
  }

  function markStale(stale, runStatus) {
    var box = panel.querySelector(".diagnosis-suggestion");
    if (!box.getAttribute("data-suggestion")) { return; }
    box.setAttribute("data-stale", stale ? "true" : "false");
    var note = box.querySelector(".diagnosis-stale");
    note.hidden = !stale;
    if (runStatus) { box.querySelector(".diagnosis-stale-status").textContent = runStatus; }
  }

  document.addEventListener("orchestrator:event", function (domEvent) {
    var event = domEvent.detail;
    if (!event || event.run !== runId || !event.type) { return; }
    if (event.type === "diagnosis_explanation" && event.explanation) {
      upsertExplanation(event);
    } else if (event.type === "diagnosis_suggestion" && event.suggestion) {
      showSuggestion(event.suggestion);
    } else if (event.type.indexOf("run_") === 0 || (event.type.indexOf("step_") === 0 && event.type !== "step_running")) {
      markStale(true, event.type.indexOf("run_") === 0 ? event.to : null);
    }
  });
})();

// Deployment page: draw the figures embedded in the page, then refresh them every few seconds.
(function () {
  "use strict";
  var root = document.getElementById("charts");
  if (!root || !window.Plotly) { return; }
  // Phones get no mode bar: it would cover the chart titles.
  var config = { displaylogo: false, responsive: true,
                 displayModeBar: window.matchMedia("(max-width: 600px)").matches ? false : "hover",
                 modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d"] };
  var formats = {
    pct: function (v) { return (v * 100).toFixed(1) + "%"; },
    pct2: function (v) { return (v * 100).toFixed(2) + "%"; },
    num: function (v) { return v.toFixed(2); },
    x: function (v) { return v.toFixed(2) + "×"; },
    int: function (v) { return Math.round(v).toLocaleString("en-US"); }
  };

  function draw(payload) {
    Object.keys(payload.figures).forEach(function (key) {
      var element = document.getElementById("chart-" + key);
      if (element) {
        var figure = payload.figures[key];
        Plotly.react(element, figure.data, figure.layout, config);
      }
    });
    document.querySelectorAll("[data-stat]").forEach(function (element) {
      var value = payload.totals[element.getAttribute("data-stat")];
      element.textContent = value === null || value === undefined ? "—"
        : formats[element.getAttribute("data-format")](value);
      var limit = element.getAttribute("data-limit");
      if (limit !== null) {
        element.classList.toggle("text-bad", value !== null && value > parseFloat(limit));
      }
    });
    (payload.segments || []).forEach(function (row) {
      var line = document.querySelector('tr[data-segment="' + CSS.escape(row.segment) + '"]');
      if (!line) { return; }
      line.querySelectorAll("[data-segment-stat]").forEach(function (element) {
        var value = row[element.getAttribute("data-segment-stat")];
        element.textContent = value === null || value === undefined ? "—"
          : formats[element.getAttribute("data-format")](value);
        var limit = element.getAttribute("data-limit");
        if (limit !== null) {
          element.classList.toggle("text-bad", value !== null && value > parseFloat(limit));
        }
      });
    });
    var updated = document.getElementById("updated");
    if (updated && payload.updated) { updated.textContent = payload.updated.slice(11, 19); }
    root.setAttribute("data-drawn", payload.updated || "yes");
  }

  function refresh() {
    if (document.hidden) { return; }
    fetch(root.getAttribute("data-src"), { credentials: "same-origin",
                                           headers: { Accept: "application/json" } })
      .then(function (response) {
        if (response.redirected || !response.ok) { throw new Error("HTTP " + response.status); }
        return response.json();
      })
      .then(draw)
      .catch(function () {
        var updated = document.getElementById("updated");
        if (updated) { updated.textContent = "refresh failed; retrying"; }
      });
  }

  draw(JSON.parse(document.getElementById("charts-initial").textContent));
  var every = parseInt(root.getAttribute("data-refresh"), 10) * 1000;
  if (every > 0) { window.setInterval(refresh, every); }
  document.addEventListener("visibilitychange", function () { if (!document.hidden) { refresh(); } });
}());

// Static figures embedded in a page as JSON (<script type="application/json" data-figure-for>).
(function () {
  "use strict";
  if (!window.Plotly) { return; }
  var narrow = window.matchMedia("(max-width: 600px)").matches;
  document.querySelectorAll("script[data-figure-for]").forEach(function (source) {
    var target = document.getElementById(source.getAttribute("data-figure-for"));
    var figure = JSON.parse(source.textContent);
    Plotly.newPlot(target, figure.data, figure.layout,
                   { displaylogo: false, responsive: true, displayModeBar: narrow ? false : "hover" })
      .then(function () { target.setAttribute("data-drawn", "yes"); });
  });
}());

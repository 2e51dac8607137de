// Loraplex dashboard behaviour: confirmations, the tenant switcher, dataset drag-and-drop with upload
// progress, the canary slider's readout, copy buttons, the new-job token estimate and the live loss
// chart (uPlot). Everything degrades to plain forms without JavaScript.
(function () {
  "use strict";

  // Forms with data-confirm ask first; capture phase, so it runs before htmx sees the submit.
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (form.dataset && form.dataset.confirm && !window.confirm(form.dataset.confirm)) {
      event.preventDefault();
      event.stopImmediatePropagation();
    }
  }, true);

  document.addEventListener("change", function (event) {
    var target = event.target;
    if (target.matches("select[data-autosubmit]")) target.form.requestSubmit();
    if (target.matches("[data-upload] input[type=file]")) showChosen(target.form);
    if (target.matches("[data-estimate], [data-epochs]")) updateEstimate();
  });
  document.addEventListener("input", function (event) {
    var target = event.target;
    if (target.dataset && target.dataset.output) {
      document.getElementById(target.dataset.output).textContent = target.value + "%";
    }
    if (target.matches("[data-epochs]")) updateEstimate();
  });

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button) return;
    var text = document.getElementById(button.dataset.copy).textContent.trim();
    navigator.clipboard.writeText(text).then(function () {
      button.textContent = "Copied";
    }, function () {
      button.textContent = "Select and copy";
    });
  });

  function showChosen(form) {
    var input = form.querySelector("input[type=file]");
    var chosen = form.querySelector(".chosen");
    if (chosen && input.files.length) chosen.textContent = input.files[0].name + " (" + input.files[0].size + " bytes)";
  }

  function setupDropzones() {
    document.querySelectorAll("[data-upload]").forEach(function (form) {
      if (form.dataset.ready) return;
      form.dataset.ready = "1";
      ["dragenter", "dragover"].forEach(function (name) {
        form.addEventListener(name, function (event) { event.preventDefault(); form.classList.add("dragging"); });
      });
      ["dragleave", "drop"].forEach(function (name) {
        form.addEventListener(name, function () { form.classList.remove("dragging"); });
      });
      form.addEventListener("drop", function (event) {
        event.preventDefault();
        if (!event.dataTransfer.files.length) return;
        form.querySelector("input[type=file]").files = event.dataTransfer.files;
        showChosen(form);
        form.requestSubmit();
      });
      form.addEventListener("htmx:xhr:progress", function (event) {
        var bar = form.querySelector(".upload-progress");
        if (!event.detail.lengthComputable) return;
        bar.hidden = false;
        bar.value = Math.round(100 * event.detail.loaded / event.detail.total);
      });
    });
  }

  function updateEstimate() {
    var out = document.getElementById("estimate");
    var select = document.querySelector("[data-estimate]");
    if (!out || !select || !select.selectedOptions.length) return;
    var tokens = Number(select.selectedOptions[0].dataset.tokens || 0);
    var epochsField = document.querySelector("[data-epochs]");
    var epochs = Number(epochsField.value || out.dataset.defaultEpochs);
    out.textContent = tokens ? (tokens * epochs).toLocaleString() + " (" + tokens.toLocaleString() + " × " + epochs + " epochs)" : "unknown (tokens were not counted)";
  }

  // The loss chart: the element is kept across htmx polls (hx-preserve); only its data changes.
  var lossChart = null;
  function renderLossChart() {
    var element = document.getElementById("loss-chart");
    var source = document.getElementById("loss-data");
    if (!element || !source || typeof uPlot === "undefined") return;
    var points = JSON.parse(source.textContent);
    var data = [
      points.map(function (p) { return p.step; }),
      points.map(function (p) { return p.train_loss == null ? null : p.train_loss; }),
      points.map(function (p) { return p.valid_loss == null ? null : p.valid_loss; }),
    ];
    element.dataset.points = String(points.length);
    if (!points.length) {
      if (!element.querySelector(".empty-chart")) element.innerHTML = '<div class="empty-chart">The loss appears here once the first steps are logged.</div>';
      return;
    }
    if (lossChart && lossChart.root.isConnected) {
      lossChart.setData(data);
      return;
    }
    element.innerHTML = "";
    lossChart = new uPlot({
      width: element.clientWidth || 600,
      height: 260,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { label: "loss" }],
      series: [
        { label: "step" },
        { label: "train loss", stroke: "#4f46e5", width: 2, spanGaps: true, points: { show: points.length < 60 } },
        { label: "valid loss", stroke: "#d97706", width: 2, spanGaps: true, dash: [6, 4], points: { show: true } },
      ],
    }, data, element);
  }
  window.addEventListener("resize", function () {
    var element = document.getElementById("loss-chart");
    if (lossChart && element) lossChart.setSize({ width: element.clientWidth, height: 260 });
  });

  function setup() {
    setupDropzones();
    renderLossChart();
    updateEstimate();
  }
  document.addEventListener("DOMContentLoaded", setup);
  document.addEventListener("htmx:afterSettle", setup);
})();

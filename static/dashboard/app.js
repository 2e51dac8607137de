// Loraplex dashboard behaviour: confirmations, the tenant switcher, dataset drag-and-drop with upload
// progress, the canary slider's readout, copy buttons, the new-job token estimate, the live loss
// chart and the usage chart (uPlot), and the playground (streamed chat through /v1). Everything degrades to plain forms without JavaScript.
(function () {
  "use strict";

  // Forms with data-confirm ask first; capture phase, so it runs before htmx sees the submit. Those
  // with data-ask-reason or an input[data-ask-weight] ask in the page's action dialog, which takes a
  // reason for the audit trail and a canary's share of traffic into the form; the others ask with
  // window.confirm. Without JavaScript the forms submit as they are (no reason, the default weight).
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (!form.dataset || !form.dataset.confirm) return;
    if (form.dataset.confirmed) {
      delete form.dataset.confirmed;
      return;
    }
    var dialog = document.getElementById("action-dialog");
    var weight = form.querySelector("[data-ask-weight]");
    var asksReason = form.dataset.askReason !== undefined;
    event.preventDefault();
    event.stopImmediatePropagation();
    if (!dialog || typeof dialog.showModal !== "function" || (!asksReason && !weight)) {
      if (window.confirm(form.dataset.confirm)) submitConfirmed(form);
      return;
    }
    askInDialog(dialog, form, weight, asksReason);
  }, true);

  function submitConfirmed(form) {
    form.dataset.confirmed = "1";
    form.requestSubmit();
  }

  function askInDialog(dialog, form, weight, asksReason) {
    var weightInput = document.getElementById("action-dialog-weight");
    var reasonInput = document.getElementById("action-dialog-reason");
    document.getElementById("action-dialog-text").textContent = form.dataset.confirm;
    document.getElementById("action-dialog-weight-field").hidden = !weight;
    weightInput.disabled = !weight;
    if (weight) weightInput.value = weight.value;
    document.getElementById("action-dialog-reason-field").hidden = !asksReason;
    reasonInput.value = "";
    dialog.returnValue = "";
    dialog.onclose = function () {
      dialog.onclose = null;
      if (dialog.returnValue !== "ok") return;
      if (weight) weight.value = weightInput.value;
      var reason = form.querySelector("input[name=reason]");
      if (reason) reason.value = reasonInput.value.trim();
      submitConfirmed(form);
    };
    dialog.showModal();
    (weight ? weightInput : reasonInput).focus();
  }

  // "Limits" on the keys page opens the key's form below the table.
  document.addEventListener("click", function (event) {
    var link = event.target.closest("[data-open-details]");
    if (!link) return;
    var details = document.querySelector(link.getAttribute("href"));
    if (details) details.open = true;
  });

  document.addEventListener("change", function (event) {
    var target = event.target;
    if (target.matches("select[data-autosubmit]")) target.form.requestSubmit();
    if (target.matches("[data-upload] input[type=file]")) showChosen(target.form);
    if (target.matches("[data-estimate], [data-epochs]")) updateEstimate();
    if (target.matches("select[data-method]")) showMethodFields();
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
    var option = select.selectedOptions[0];
    var tokens = Number(option.dataset.tokens || 0);
    var epochsField = document.querySelector("[data-epochs]");
    // An empty n_epochs is "auto": the epochs the platform picks for this dataset's size.
    var auto = !epochsField.value;
    var epochs = Number(auto ? option.dataset.autoEpochs : epochsField.value);
    out.textContent = tokens ? (tokens * epochs).toLocaleString() + " (" + tokens.toLocaleString() + " × " + epochs + " epochs" + (auto ? ", auto" : "") + ")" : "unknown (tokens were not counted)";
    // The time it takes at the pace of the tenant's last finished job, where one was measured.
    var duration = document.getElementById("estimate-duration");
    var pace = duration ? Number(duration.dataset.tokensPerSecond || 0) : 0;
    if (duration) duration.textContent = tokens && pace ? " · about " + formatDuration(tokens * epochs / pace) + " at your last job's " + Math.round(pace).toLocaleString() + " trained tokens/s" : "";
  }

  function formatDuration(seconds) {
    if (seconds < 90) return Math.max(1, Math.round(seconds)) + " s";
    if (seconds < 5400) return Math.round(seconds / 60) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }

  // A field of one method (DPO's beta) shows only while that method is chosen; hidden, it is not sent.
  function showMethodFields() {
    var select = document.querySelector("select[data-method]");
    if (!select) return;
    document.querySelectorAll("[data-method-only]").forEach(function (field) {
      var shown = field.dataset.methodOnly === select.value;
      field.hidden = !shown;
      field.querySelectorAll("input").forEach(function (input) { input.disabled = !shown; });
    });
  }

  // The loss chart: the element is kept across htmx polls (hx-preserve); only its data changes.
  var lossChart = null;
  function renderLossChart() {
    var element = document.getElementById("loss-chart");
    var source = document.getElementById("loss-data");
    if (!element || !source || typeof uPlot === "undefined") return;
    var points = JSON.parse(source.textContent);
    // A job without validation examples has no validation series (nor its legend).
    var validated = element.dataset.validated === "1";
    var data = [
      points.map(function (p) { return p.step; }),
      points.map(function (p) { return p.train_loss == null ? null : p.train_loss; }),
    ];
    if (validated) data.push(points.map(function (p) { return p.valid_loss == null ? null : p.valid_loss; }));
    element.dataset.points = String(points.length);
    if (!points.length) {
      if (!element.querySelector(".empty-chart")) element.innerHTML = '<div class="empty-chart">The loss appears here after the first step.</div>';
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
      ].concat(validated ? [
        { label: "valid loss", stroke: "#d97706", width: 2, spanGaps: true, dash: [6, 4], points: { show: true } },
      ] : []),
    }, data, element);
  }
  window.addEventListener("resize", function () {
    var element = document.getElementById("loss-chart");
    if (lossChart && element) lossChart.setSize({ width: element.clientWidth, height: 260 });
  });


  // The usage chart: tokens and requests per day.
  function renderUsageChart() {
    var element = document.getElementById("usage-chart");
    var source = document.getElementById("usage-data");
    if (!element || !source || typeof uPlot === "undefined" || element.dataset.drawn) return;
    var rows = JSON.parse(source.textContent);
    element.dataset.drawn = "1";
    if (!rows.length) { element.hidden = true; return; }
    var data = [
      rows.map(function (r) { return Date.parse(r.day + "T00:00:00Z") / 1000; }),
      rows.map(function (r) { return r.total_tokens; }),
      rows.map(function (r) { return r.requests; }),
    ];
    new uPlot({
      width: element.clientWidth || 600, height: 220,
      scales: { y: {}, requests: {} },
      axes: [{}, { label: "tokens" }, { side: 1, scale: "requests", label: "requests", grid: { show: false } }],
      series: [
        { label: "day", value: "{YYYY}-{MM}-{DD}" },
        { label: "tokens", stroke: "#4f46e5", fill: "rgba(79,70,229,.12)", width: 2, points: { show: true } },
        { label: "requests", stroke: "#d97706", width: 2, scale: "requests", points: { show: true } },
      ],
    }, data, element);
  }

  // The playground: chat through the public gateway with the user's playground key, streamed.
  var playgroundKey = null;
  function getPlaygroundKey(form) {
    if (playgroundKey) return Promise.resolve(playgroundKey);
    var token = document.querySelector("[name=csrfmiddlewaretoken]") || null;
    var csrf = token ? token.value : JSON.parse(document.body.getAttribute("hx-headers"))["X-CSRFToken"];
    return fetch(form.dataset.keyUrl, { method: "POST", headers: { "X-CSRFToken": csrf }, credentials: "same-origin" })
      .then(function (response) {
        if (!response.ok) throw new Error("could not get a playground key (HTTP " + response.status + ")");
        return response.json();
      })
      .then(function (data) { playgroundKey = data.key; return playgroundKey; });
  }

  function playgroundRequest(model) {
    var messages = [];
    var system = document.getElementById("pg-system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: document.getElementById("pg-prompt").value });
    return {
      model: model, messages: messages, stream: true, stream_options: { include_usage: true },
      max_tokens: Number(document.getElementById("pg-max-tokens").value),
      temperature: Number(document.getElementById("pg-temperature").value),
    };
  }

  function streamInto(pane, form, key, body) {
    var output = pane.querySelector(".pg-output");
    var meta = pane.querySelector(".pg-meta");
    pane.querySelector(".pg-title").textContent = body.model;
    output.textContent = "";
    output.classList.remove("pg-error");
    meta.textContent = "waiting…";
    pane.dataset.state = "streaming";
    var started = performance.now();
    var firstToken = null;
    var usage = null;
    var served = null;
    return fetch(form.dataset.endpoint, {
      method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", "Authorization": "Bearer " + key },
    }).then(function (response) {
      var version = response.headers.get("x-loraplex-adapter-version");
      served = version ? "served by version " + version : null;
      if (response.headers.get("x-loraplex-degraded")) served = "over quota: degraded to the base model";
      if (!response.ok) {
        return response.json().then(function (error) {
          throw new Error((error.error && error.error.message) || ("HTTP " + response.status));
        });
      }
      var reader = response.body.getReader();
      var decoder = new TextDecoder();
      var buffer = "";
      function pump() {
        return reader.read().then(function (chunk) {
          if (chunk.done) return;
          buffer += decoder.decode(chunk.value, { stream: true });
          var events = buffer.split("\n\n");
          buffer = events.pop();
          events.forEach(function (event) {
            event.split("\n").forEach(function (line) {
              if (line.indexOf("data:") !== 0) return;
              var payload = line.slice(5).trim();
              if (payload === "[DONE]") return;
              var data = JSON.parse(payload);
              if (data.usage) usage = data.usage;
              (data.choices || []).forEach(function (choice) {
                var text = choice.delta && choice.delta.content;
                if (text) {
                  if (firstToken === null) firstToken = performance.now();
                  output.textContent += text;
                  pane.dataset.chunks = String(Number(pane.dataset.chunks || 0) + 1);
                }
              });
            });
          });
          return pump();
        });
      }
      return pump();
    }).then(function () {
      var total = Math.round(performance.now() - started);
      var parts = [];
      if (usage) parts.push(usage.prompt_tokens + " prompt + " + usage.completion_tokens + " completion tokens");
      if (firstToken !== null) parts.push("first token " + Math.round(firstToken - started) + " ms");
      parts.push("total " + total + " ms");
      if (served) parts.push(served);
      meta.textContent = parts.join(" · ");
      pane.dataset.state = "done";
    }).catch(function (error) {
      output.textContent = error.message;
      output.classList.add("pg-error");
      meta.textContent = "";
      pane.dataset.state = "error";
    });
  }

  function shellQuote(text) { return "'" + text.replace(/'/g, "'\\''") + "'"; }

  function requestCode(form, kind) {
    var body = playgroundRequest(document.getElementById("pg-model-a").value);
    var url = form.dataset.origin + form.dataset.endpoint;
    if (kind === "curl") {
      return "curl " + url + " \\\n  -H \"Authorization: Bearer $LORAPLEX_API_KEY\" \\\n" +
        "  -H 'Content-Type: application/json' \\\n  -d " + shellQuote(JSON.stringify(body, null, 2));
    }
    var messages = JSON.stringify(body.messages, null, 4).replace(/\n/g, "\n    ");
    return "import os\nfrom openai import OpenAI\n\n" +
      "client = OpenAI(base_url=" + JSON.stringify(form.dataset.origin + "/v1") + ", api_key=os.environ[\"LORAPLEX_API_KEY\"])\n" +
      "stream = client.chat.completions.create(\n    model=" + JSON.stringify(body.model) + ",\n    messages=" + messages +
      ",\n    max_tokens=" + body.max_tokens + ",\n    temperature=" + body.temperature + ",\n    stream=True,\n)\n" +
      "for chunk in stream:\n    if chunk.choices and chunk.choices[0].delta.content:\n" +
      "        print(chunk.choices[0].delta.content, end=\"\", flush=True)\n";
  }

  function setupPlayground() {
    var form = document.getElementById("playground");
    if (!form || form.dataset.ready) return;
    form.dataset.ready = "1";
    var compare = document.getElementById("pg-compare");
    compare.addEventListener("change", function () {
      document.getElementById("pg-model-b-field").hidden = !compare.checked;
      document.getElementById("pg-pane-b").hidden = !compare.checked;
      document.getElementById("pg-panes").classList.toggle("two", compare.checked);
    });
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      var send = document.getElementById("pg-send");
      send.disabled = true;
      getPlaygroundKey(form).then(function (key) {
        var runs = [streamInto(document.getElementById("pg-pane-a"), form, key,
                               playgroundRequest(document.getElementById("pg-model-a").value))];
        if (compare.checked) {
          runs.push(streamInto(document.getElementById("pg-pane-b"), form, key,
                               playgroundRequest(document.getElementById("pg-model-b").value)));
        }
        return Promise.all(runs);
      }).catch(function (error) {
        var pane = document.getElementById("pg-pane-a");
        pane.querySelector(".pg-output").textContent = error.message;
        pane.dataset.state = "error";
      }).then(function () { send.disabled = false; });
    });
    form.querySelectorAll("[data-copy-request]").forEach(function (button) {
      button.addEventListener("click", function () {
        var code = requestCode(form, button.dataset.copyRequest);
        document.getElementById("pg-code").hidden = false;
        document.getElementById("pg-code-text").textContent = code;
        var note = document.getElementById("pg-copied");
        navigator.clipboard.writeText(code).then(function () { note.textContent = "Copied; set LORAPLEX_API_KEY to one of your keys."; },
          function () { note.textContent = "Shown below; copy it from there."; });
      });
    });
  }

  // A flash message about a state ("queued", "validating it now") carries data-while="<thing>:<states>";
  // once the page shows that thing (data-state-of) in another state, the message is out of date and goes.
  function dropStaleFlash() {
    var flash = document.getElementById("flash");
    if (!flash) return;
    flash.querySelectorAll("[data-while]").forEach(function (item) {
      var parts = item.dataset.while.split(":");
      var shown = document.querySelector('[data-state-of="' + parts[0] + '"]');
      if (shown && parts[1].split(",").indexOf(shown.dataset.state) < 0) item.remove();
    });
    flash.hidden = !flash.children.length;
  }

  function setup() {
    dropStaleFlash();
    setupDropzones();
    renderLossChart();
    renderUsageChart();
    setupPlayground();
    updateEstimate();
    showMethodFields();
  }
  document.addEventListener("DOMContentLoaded", setup);
  document.addEventListener("htmx:afterSettle", setup);
})();

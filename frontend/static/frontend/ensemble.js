// The ensemble composer: steps picked from the team's own models, each step input wired to a tensor that fits
// (same dtype, compatible shape: an ensemble input or an earlier step's output), each step output named and
// optionally made an ensemble output. It only builds the compose API's spec; the platform checks it.
(function () {
  "use strict";

  var choices = [];
  var state = { steps: [], maxBatch: null, note: "" };

  function model(slug) { return choices.find(function (m) { return m.slug === slug; }) || null; }

  function versionOf(step) {
    var m = model(step.model);
    if (!m) return null;
    var number = step.version === null ? m.serving : step.version;
    return m.versions.find(function (v) { return v.number === number; }) || null;
  }

  function dimsFit(a, b) {
    return a.length === b.length && a.every(function (d, i) { return d < 0 || b[i] < 0 || d === b[i]; });
  }

  function shape(t) { return t.dtype + " [" + t.dims.join(", ") + "]"; }

  function freshStep(slug) {
    return { model: slug, version: null, inputs: {}, names: {}, outputs: {}, exported: {} };
  }

  // Every tensor known before step i: {name: {dtype, dims, from}}.
  function tensorsBefore(i) {
    var known = {};
    state.steps.slice(0, i).forEach(function (step, j) {
      var v = versionOf(step);
      if (!v) return;
      v.signature.inputs.forEach(function (t) {
        if (step.inputs[t.name] === "new") {
          var name = step.names[t.name] || t.name;
          if (!known[name]) known[name] = { dtype: t.dtype, dims: t.dims, from: "ensemble input" };
        }
      });
      v.signature.outputs.forEach(function (t) {
        var name = step.outputs[t.name];
        if (name) known[name] = { dtype: t.dtype, dims: t.dims, from: "step[" + j + "] " + step.model + "." + t.name };
      });
    });
    return known;
  }

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "className") node.className = attrs[k];
      else if (k === "selected" || k === "checked") node[k] = Boolean(attrs[k]);
      else node.setAttribute(k, attrs[k]);
    });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function defaults(step, i) {
    var v = versionOf(step);
    if (!v) return;
    var known = tensorsBefore(i);
    v.signature.inputs.forEach(function (t) {
      var source = step.inputs[t.name];
      var fits = Object.keys(known).filter(function (n) { return known[n].dtype === t.dtype && dimsFit(known[n].dims, t.dims); });
      if (source === "new") return;
      if (source && fits.indexOf(source.slice(2)) >= 0) return;
      // The latest fitting tensor (an earlier step's output, usually), else a new ensemble input.
      step.inputs[t.name] = fits.length ? "t:" + fits[fits.length - 1] : "new";
    });
    v.signature.outputs.forEach(function (t) {
      if (step.outputs[t.name] === undefined) step.outputs[t.name] = step.model + "_" + t.name;
    });
  }

  // A tensor's name changes what later steps may be wired to: the editor is drawn again on every edit, and
  // the field being typed in keeps the focus and the caret.
  function focusKey() {
    var active = document.activeElement;
    var card = active && active.closest ? active.closest("fieldset.compose-step") : null;
    if (!card || active.tagName !== "INPUT" || active.type !== "text") return null;
    return {
      selector: 'fieldset[data-position="' + card.dataset.position + '"] input.' + active.className.split(" ")[0] +
        (active.dataset.input ? '[data-input="' + active.dataset.input + '"]' : '[data-output="' + active.dataset.output + '"]'),
      caret: active.selectionStart,
    };
  }

  function render() {
    var key = focusKey();
    var box = document.getElementById("compose-steps");
    box.textContent = "";
    state.steps.forEach(function (step, i) {
      defaults(step, i);
      var v = versionOf(step);
      var m = model(step.model);
      var card = el("fieldset", { className: "compose-step", "data-position": String(i) });
      card.appendChild(el("legend", {}, "step[" + i + "]"));
      var pick = el("select", { className: "step-model", "aria-label": "Model of step " + i });
      choices.forEach(function (c) { pick.appendChild(el("option", { value: c.slug, selected: c.slug === step.model }, c.name + " (" + c.slug + ")")); });
      pick.addEventListener("change", function () { state.steps[i] = freshStep(pick.value); render(); });
      card.appendChild(pick);
      var version = el("select", { className: "step-version", "aria-label": "Version of step " + i });
      version.appendChild(el("option", { value: "", selected: step.version === null }, "the version serving (v" + (m ? m.serving : "?") + ")"));
      (m ? m.versions : []).forEach(function (each) {
        version.appendChild(el("option", { value: String(each.number), selected: step.version === each.number }, "v" + each.number));
      });
      version.addEventListener("change", function () { step.version = version.value ? parseInt(version.value, 10) : null; render(); });
      card.appendChild(version);
      if (v) {
        var known = tensorsBefore(i);
        v.signature.inputs.forEach(function (t) {
          var row = el("div", { className: "wire-row step-input-row", "data-input": t.name });
          row.appendChild(el("span", {}, "input " + t.name + " · " + shape(t)));
          var cell = el("span");
          var select = el("select", { className: "step-input", "data-input": t.name, "aria-label": "Step " + i + " input " + t.name });
          Object.keys(known).forEach(function (n) {
            if (known[n].dtype !== t.dtype || !dimsFit(known[n].dims, t.dims)) return;  // offer only what fits
            select.appendChild(el("option", { value: "t:" + n, selected: step.inputs[t.name] === "t:" + n }, n + " (" + known[n].from + ")"));
          });
          select.appendChild(el("option", { value: "new", selected: step.inputs[t.name] === "new" }, "a new ensemble input…"));
          select.addEventListener("change", function () { step.inputs[t.name] = select.value; render(); });
          cell.appendChild(select);
          if (step.inputs[t.name] === "new") {
            var name = el("input", { type: "text", className: "step-input-name", "data-input": t.name, value: step.names[t.name] || t.name, "aria-label": "Ensemble input name for step " + i + " input " + t.name });
            name.addEventListener("input", function () { step.names[t.name] = name.value; render(); });
            cell.appendChild(name);
          }
          row.appendChild(cell);
          card.appendChild(row);
        });
        v.signature.outputs.forEach(function (t) {
          var row = el("div", { className: "wire-row step-output-row", "data-output": t.name });
          row.appendChild(el("span", {}, "output " + t.name + " · " + shape(t)));
          var cell = el("span");
          var name = el("input", { type: "text", className: "step-output", "data-output": t.name, value: step.outputs[t.name], "aria-label": "Tensor name of step " + i + " output " + t.name });
          name.addEventListener("input", function () { step.outputs[t.name] = name.value; render(); });
          cell.appendChild(name);
          var label = el("label", { className: "checkbox" });
          var check = el("input", { type: "checkbox", className: "step-export", "data-output": t.name, checked: step.exported[t.name] });
          check.addEventListener("change", function () { step.exported[t.name] = check.checked; sync(); });
          label.appendChild(check);
          label.appendChild(document.createTextNode(" ensemble output"));
          cell.appendChild(label);
          row.appendChild(cell);
          card.appendChild(row);
        });
      }
      var remove = el("button", { type: "button", className: "outline secondary compact remove-step" }, "Remove step");
      remove.addEventListener("click", function () { state.steps.splice(i, 1); render(); });
      card.appendChild(remove);
      box.appendChild(card);
    });
    var batch = document.getElementById("compose-max-batch");
    if (state.maxBatch === null) {
      var sizes = state.steps.map(function (s) { var v = versionOf(s); return v ? v.max_batch_size : 0; });
      batch.value = sizes.length ? Math.min.apply(null, sizes) : 0;
    }
    sync();
    var again = key && document.querySelector(key.selector);
    if (again) {
      again.focus();
      again.setSelectionRange(key.caret, key.caret);
    }
  }

  function spec() {
    var inputs = [], outputs = [], seen = {};
    var steps = state.steps.map(function (step) {
      var v = versionOf(step);
      var inputMap = {}, outputMap = {};
      (v ? v.signature.inputs : []).forEach(function (t) {
        var source = step.inputs[t.name];
        if (source === "new") {
          var name = step.names[t.name] || t.name;
          inputMap[t.name] = name;
          if (!seen[name]) { seen[name] = true; inputs.push({ name: name }); }
        } else if (source) {
          inputMap[t.name] = source.slice(2);
        }
      });
      (v ? v.signature.outputs : []).forEach(function (t) {
        outputMap[t.name] = step.outputs[t.name];
        if (step.exported[t.name]) outputs.push({ name: step.outputs[t.name] });
      });
      return { model: step.model, version: step.version, input_map: inputMap, output_map: outputMap };
    });
    var batch = parseInt(document.getElementById("compose-max-batch").value, 10);
    return {
      max_batch_size: isNaN(batch) ? 0 : batch,
      inputs: inputs,
      outputs: outputs,
      steps: steps,
      note: document.getElementById("compose-note").value,
    };
  }

  function sync() {
    var text = JSON.stringify(spec(), null, 2);
    document.getElementById("compose-spec").value = text;
    var preview = document.getElementById("compose-preview");
    if (preview) preview.textContent = text;
  }

  // A spec posted back with errors: the editor as it was.
  function restore(previous) {
    var ensembleInputs = {};
    (previous.inputs || []).forEach(function (t) { ensembleInputs[t.name] = true; });
    var exported = {};
    (previous.outputs || []).forEach(function (t) { exported[t.name] = true; });
    var introduced = {};
    state.steps = (previous.steps || []).map(function (s) {
      var step = freshStep(s.model);
      step.version = typeof s.version === "number" ? s.version : null;
      Object.keys(s.input_map || {}).forEach(function (k) {
        var name = s.input_map[k];
        if (ensembleInputs[name] && !introduced[name]) {
          introduced[name] = true;
          step.inputs[k] = "new";
          step.names[k] = name;
        } else {
          step.inputs[k] = "t:" + name;
        }
      });
      Object.keys(s.output_map || {}).forEach(function (k) {
        step.outputs[k] = s.output_map[k];
        step.exported[k] = Boolean(exported[s.output_map[k]]);
      });
      return step;
    });
    if (typeof previous.max_batch_size === "number") state.maxBatch = previous.max_batch_size;
    document.getElementById("compose-max-batch").value = previous.max_batch_size || 0;
    document.getElementById("compose-note").value = previous.note || "";
  }

  document.addEventListener("DOMContentLoaded", function () {
    var form = document.getElementById("compose-form");
    if (!form) return;
    choices = JSON.parse(document.getElementById("step-choices").textContent);
    var previous = document.getElementById("posted-spec");
    if (previous) restore(JSON.parse(previous.textContent) || {});
    document.getElementById("add-step").addEventListener("click", function () {
      if (!choices.length) return;
      state.steps.push(freshStep(choices[0].slug));
      render();
    });
    var batch = document.getElementById("compose-max-batch");
    batch.addEventListener("input", function () { state.maxBatch = parseInt(batch.value, 10); sync(); });
    document.getElementById("compose-note").addEventListener("input", sync);
    form.addEventListener("submit", sync);
    render();
  });
})();

// Resumable model upload against the platform's upload API (see apps/registry/api.py).
// XHR rather than fetch: only XHR reports upload progress, which the progress bar needs.
// After a network error the client asks the server for its offset and continues from there.
(function () {
  "use strict";

  const CHUNK_BYTES = 8 * 1024 * 1024;
  const MAX_RETRY_DELAY_MS = 30000;

  function csrfToken() {
    const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    if (match) return decodeURIComponent(match[1]);
    const headers = document.body.getAttribute("hx-headers");
    try { return JSON.parse(headers)["X-CSRFToken"]; } catch (e) { return ""; }
  }

  function humanBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
  }

  // One request; resolves with {status, body} for every HTTP answer, rejects only on network failure.
  function request(method, url, { body = null, headers = {}, onProgress = null } = {}) {
    return new Promise(function (resolve, reject) {
      const xhr = new XMLHttpRequest();
      xhr.open(method, url);
      xhr.setRequestHeader("X-CSRFToken", csrfToken());
      xhr.setRequestHeader("Accept", "application/json");
      Object.entries(headers).forEach(([k, v]) => xhr.setRequestHeader(k, v));
      if (onProgress) xhr.upload.onprogress = (e) => onProgress(e.loaded);
      xhr.onload = function () {
        let parsed = null;
        try { parsed = xhr.responseText ? JSON.parse(xhr.responseText) : null; } catch (e) { parsed = null; }
        resolve({ status: xhr.status, body: parsed, xhr: xhr });
      };
      xhr.onerror = () => reject(new Error("network error"));
      xhr.ontimeout = () => reject(new Error("timeout"));
      xhr.onabort = () => reject(new Error("aborted"));
      xhr.send(body);
      request.current = xhr;
    });
  }

  function sleep(ms) { return new Promise((r) => setTimeout(r, ms)); }

  function init(form) {
    const input = form.querySelector("#file-input");
    const zone = form.querySelector("#drop-zone");
    const fileName = form.querySelector("#file-name");
    const bar = form.querySelector("#progress-bar");
    const text = form.querySelector("#progress-text");
    const rate = form.querySelector("#progress-rate");
    const statusLine = form.querySelector("#progress-status");
    const errorBox = form.querySelector("#upload-error");
    const button = form.querySelector("#upload-button");
    const cancel = form.querySelector("#cancel-button");
    let file = null;
    let uploadUrl = null;
    let cancelled = false;

    function choose(f) {
      file = f;
      fileName.textContent = f ? f.name + " (" + humanBytes(f.size) + ")" : "";
    }
    input.addEventListener("change", () => choose(input.files[0] || null));
    zone.addEventListener("click", (e) => { if (e.target === zone) input.click(); });
    zone.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); input.click(); } });
    ["dragenter", "dragover"].forEach((t) => zone.addEventListener(t, (e) => { e.preventDefault(); zone.classList.add("dragover"); }));
    ["dragleave", "drop"].forEach((t) => zone.addEventListener(t, (e) => { e.preventDefault(); zone.classList.remove("dragover"); }));
    zone.addEventListener("drop", (e) => { if (e.dataTransfer.files.length) choose(e.dataTransfer.files[0]); });

    function showErrors(body, fallback) {
      form.querySelectorAll("[data-field]").forEach((el) => { el.textContent = ""; });
      const fields = (body && body.fields) || {};
      Object.entries(fields).forEach(([name, messages]) => {
        const el = form.querySelector('[data-field="' + name + '"]');
        if (el) el.textContent = [].concat(messages).join(" ");
      });
      errorBox.textContent = (body && body.message) || fallback;
      errorBox.hidden = false;
    }

    function progress(done, total, startedAt, startOffset) {
      const pct = total ? (100 * done) / total : 100;
      bar.value = pct;
      text.textContent = pct.toFixed(1) + "% of " + humanBytes(total);
      const seconds = (performance.now() - startedAt) / 1000;
      if (seconds > 0.5) rate.textContent = humanBytes((done - startOffset) / seconds) + "/s";
    }

    function options() {
      const data = new FormData(form);
      const value = (name) => (data.get(name) || "").toString().trim();
      const serving = {};
      ["max_batch_size", "max_queue_delay_us", "instance_count"].forEach((k) => { if (value(k) !== "") serving[k] = Number(value(k)); });
      ["preferred_batch_sizes"].forEach((k) => {
        serving[k] = value(k) ? value(k).split(",").map((s) => s.trim()).filter(Boolean).map(Number) : [];
      });
      const conversion = {};
      ["soc_version", "precision_mode", "input_format", "input_shape"].forEach((k) => { if (value(k)) conversion[k] = value(k); });
      return { serving_options: serving, conversion_options: conversion, config_text: value("config_text") };
    }

    // The server's offset, asked until the network answers again.
    async function serverOffset() {
      for (let delay = 1000; ; delay = Math.min(delay * 2, MAX_RETRY_DELAY_MS)) {
        if (cancelled) throw new Error("cancelled");
        try {
          const answer = await request("GET", uploadUrl);
          if (answer.status === 200) return answer.body.offset;
          if (answer.status < 500) throw Object.assign(new Error("status"), { answer: answer });
        } catch (e) {
          if (e.answer) throw e;
        }
        statusLine.textContent = "· connection lost, retrying in " + Math.round(delay / 1000) + " s";
        await sleep(delay);
      }
    }

    async function sendAll(offset) {
      const startedAt = performance.now();
      const startOffset = offset;
      let delay = 1000;
      const chunkBytes = Number(form.dataset.chunkBytes) || CHUNK_BYTES;
      while (offset < file.size) {
        if (cancelled) throw new Error("cancelled");
        const end = Math.min(offset + chunkBytes, file.size);
        const chunkStart = offset;
        let answer;
        try {
          answer = await request("PATCH", uploadUrl, {
            body: file.slice(chunkStart, end),
            headers: { "Upload-Offset": String(chunkStart), "Content-Type": "application/offset+octet-stream" },
            onProgress: (loaded) => progress(chunkStart + loaded, file.size, startedAt, startOffset),
          });
        } catch (e) {
          if (cancelled) throw e;
          statusLine.textContent = "· connection lost, resuming…";
          await sleep(delay);
          delay = Math.min(delay * 2, MAX_RETRY_DELAY_MS);
          offset = await serverOffset();
          statusLine.textContent = "· resumed at " + humanBytes(offset);
          continue;
        }
        if (answer.status === 200) {
          offset = answer.body.offset;
          delay = 1000;
          progress(offset, file.size, startedAt, startOffset);
        } else if (answer.status === 409 || (answer.status === 400 && answer.body && answer.body.error === "incomplete")) {
          offset = answer.body.offset;  // the server says where it is: continue from there
        } else if (answer.status >= 500) {
          await sleep(delay);
          delay = Math.min(delay * 2, MAX_RETRY_DELAY_MS);
          offset = await serverOffset();
        } else {
          throw Object.assign(new Error("rejected"), { answer: answer });
        }
      }
    }

    async function run() {
      cancelled = false;
      errorBox.hidden = true;
      if (!file) { showErrors({ fields: { filename: ["Choose a model file first."] } }, "Choose a model file first."); return; }
      button.disabled = true;
      form.querySelector("#upload-progress").hidden = false;
      try {
        statusLine.textContent = "· starting";
        const created = await request("POST", form.dataset.createUrl, {
          body: JSON.stringify(Object.assign({ filename: file.name, size: file.size }, options())),
          headers: { "Content-Type": "application/json" },
        });
        if (created.status !== 201) throw Object.assign(new Error("rejected"), { answer: created });
        uploadUrl = created.body.url;
        cancel.hidden = false;
        statusLine.textContent = "";
        await sendAll(created.body.offset);
        statusLine.textContent = "· verifying and unpacking";
        cancel.hidden = true;
        let done;
        for (let delay = 1000; ; delay = Math.min(delay * 2, MAX_RETRY_DELAY_MS)) {
          try {
            done = await request("POST", uploadUrl + "complete/", { body: "{}", headers: { "Content-Type": "application/json" } });
            if (done.status < 500) break;
          } catch (e) { /* completion is idempotent: ask again */ }
          await sleep(delay);
        }
        if (done.status !== 200) throw Object.assign(new Error("rejected"), { answer: done });
        bar.value = 100;
        statusLine.textContent = "· uploaded, conversion queued";
        const job = done.body.latest_job;
        window.location.href = job ? form.dataset.jobUrl.replace(/\/0\/$/, "/" + job.id + "/") : form.dataset.doneUrl;
      } catch (e) {
        if (e.message === "cancelled") {
          statusLine.textContent = "· cancelled";
        } else {
          showErrors(e.answer && e.answer.body, "Upload failed: " + e.message);
          statusLine.textContent = "";
        }
        button.disabled = false;
        cancel.hidden = true;
      }
    }

    form.addEventListener("submit", (e) => { e.preventDefault(); run(); });
    cancel.addEventListener("click", async () => {
      cancelled = true;
      if (request.current) request.current.abort();
      if (uploadUrl) { try { await request("DELETE", uploadUrl); } catch (e) { /* the upload stays open; the model page lists it */ } }
      uploadUrl = null;
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    const form = document.getElementById("upload-form");
    if (form) init(form);
  });
})();

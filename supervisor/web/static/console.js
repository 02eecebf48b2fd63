// The console's only script: confirmations, "select this page", and live updates over
// server-sent events (the overview's table and charts, one job's state and progress).
// Shipped with the package; no build step, nothing fetched from elsewhere.
"use strict";

function text(el, value) { if (el) el.textContent = value; }

function duration(s) {
  if (s < 1) return Math.round(s * 1000) + " ms";
  if (s < 90) return s.toFixed(1) + " s";
  if (s < 5400) return Math.round(s / 60) + " min";
  if (s < 172800) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}

function setBanners(lines) {
  const box = document.getElementById("banners");
  if (!box) return;
  box.replaceChildren(...lines.map(function (line) {
    const div = document.createElement("div");
    div.className = "banner";
    div.setAttribute("role", "alert");
    div.textContent = line;
    return div;
  }));
}

function confirmations() {
  document.querySelectorAll("form[data-confirm]").forEach(function (form) {
    form.addEventListener("submit", function (ev) {
      if (!window.confirm(form.dataset.confirm)) ev.preventDefault();
    });
  });
  // A button that destroys, beside one that does not, in one form (purge selected, replay selected).
  document.querySelectorAll("button[data-confirm]").forEach(function (button) {
    button.addEventListener("click", function (ev) {
      if (!window.confirm(button.dataset.confirm)) ev.preventDefault();
    });
  });
  const all = document.getElementById("select-page");
  if (all) all.addEventListener("change", function () {
    document.querySelectorAll("input.pick").forEach(function (box) { box.checked = all.checked; });
  });
}

const QUEUE_KEYS = ["ready", "scheduled", "waiting", "in_flight", "retrying", "dead", "done", "cancelled"];

function queueRow(tbody, q) {
  let row = tbody.querySelector('tr[data-queue="' + CSS.escape(q.queue) + '"]');
  if (row) return row;
  row = document.createElement("tr");
  row.dataset.queue = q.queue;
  const name = document.createElement("td");
  const link = document.createElement("a");
  link.href = "/jobs?queue=" + encodeURIComponent(q.queue);
  link.textContent = q.queue;
  name.appendChild(link);
  row.appendChild(name);
  QUEUE_KEYS.concat(["oldest_ready_age", "paused"]).forEach(function (k) {
    const td = document.createElement("td");
    td.dataset.k = k;
    row.appendChild(td);
  });
  tbody.appendChild(row);
  return row;
}

function drawChart(canvas, values, bucket) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 18;
  const top = Math.max(1, Math.max.apply(null, values));
  const style = getComputedStyle(canvas);
  ctx.clearRect(0, 0, w, h);
  ctx.fillStyle = style.getPropertyValue("--axis") || "#999";
  ctx.font = "11px sans-serif";
  ctx.fillText(String(top), 2, 11);
  ctx.fillText("-60 min", 2, h - 3);
  ctx.fillText("now", w - 24, h - 3);
  ctx.fillStyle = style.color || "#2a6";
  const bw = (w - 2) / values.length;
  values.forEach(function (v, i) {
    const bh = (h - pad - 12) * v / top;
    ctx.fillRect(1 + i * bw, h - pad - bh, Math.max(1, bw - 1), bh);
  });
}

function cell(row, value) {
  const td = document.createElement("td");
  td.textContent = value;
  row.appendChild(td);
}

function supervisors(records, now) {
  const tbody = document.querySelector("#supervisors-summary tbody");
  if (!tbody) return;
  const rows = records.map(function (s) {
    const row = document.createElement("tr");
    if (s.gone) row.className = "gone";
    const workers = s.workers || [];
    cell(row, s.host);
    cell(row, String(s.pid));
    cell(row, workers.filter(function (w) { return w.job_id; }).length + " / " + workers.length);
    cell(row, duration(Math.max(0, now - s.last_heartbeat)) + " ago" + (s.gone ? " (gone)" : ""));
    return row;
  });
  if (!rows.length) {
    const row = document.createElement("tr");
    row.className = "empty";
    cell(row, "No supervisor records.");
    row.firstChild.colSpan = 4;
    rows.push(row);
  }
  tbody.replaceChildren(...rows);
}

function overview() {
  const tbody = document.querySelector("#queues tbody");
  const source = new EventSource("/events/overview");
  source.addEventListener("overview", function (ev) {
    const snap = JSON.parse(ev.data);
    setBanners(snap.problems || []);
    snap.queues.forEach(function (q) {
      const row = queueRow(tbody, q);
      QUEUE_KEYS.forEach(function (k) { text(row.querySelector('[data-k="' + k + '"]'), String(q[k] || 0)); });
      text(row.querySelector('[data-k="oldest_ready_age"]'), q.ready ? duration(q.oldest_ready_age) : "-");
      const state = row.querySelector('[data-k="paused"]');
      const badge = document.createElement("span");
      badge.className = "badge " + (q.paused ? "paused" : "ok");
      badge.textContent = q.paused ? "paused" : "running";
      state.replaceChildren(badge);
    });
    document.querySelectorAll("canvas.chart").forEach(function (c) {
      drawChart(c, snap.series[c.dataset.kind], snap.series.bucket);
    });
    supervisors(snap.supervisors || [], snap.at);
    const dot = document.getElementById("live-dot");
    if (dot) { dot.classList.add("on"); dot.title = "updated " + new Date(snap.at * 1000).toLocaleTimeString(); }
  });
  source.onerror = function () {
    const dot = document.getElementById("live-dot");
    if (dot) dot.classList.remove("on");
    stopped(source);
  };
}

// The browser retries a dropped stream by itself; one it gave up on (the session ended, the
// console restarted with new keys) never updates again: say so rather than show stale figures.
function stopped(source) {
  if (source.readyState === EventSource.CLOSED) {
    setBanners(["Live updates stopped (logged out, or the console restarted): reload the page."]);
  }
}

function jobPage() {
  const box = document.getElementById("job");
  if (!box || box.dataset.live !== "yes") return;
  const source = new EventSource("/events/jobs/" + encodeURIComponent(box.dataset.jobId));
  source.addEventListener("job", function (ev) {
    const job = JSON.parse(ev.data);
    const state = document.getElementById("job-state");
    state.textContent = job.state;
    state.className = "state state-" + job.state;
    text(document.getElementById("job-reason"), job.reason ? " (" + job.reason + ")" : "");
    text(document.getElementById("job-attempt"), String(job.attempt));
    const bar = document.getElementById("job-progress");
    if (job.progress !== null && job.progress !== undefined) {
      bar.value = job.progress;
      text(document.getElementById("job-progress-text"), Math.round(job.progress * 100) + "%");
    }
    text(document.getElementById("job-progress-note"), job.progress_note || "");
    const req = job.cancel_request;
    text(document.getElementById("job-cancel-request"),
         req ? "cancel requested" + (req.by ? " by " + req.by : "") + (req.reason ? ": " + req.reason : "") : "");
    text(document.getElementById("job-finished"), job.finished_text);
    text(document.getElementById("result"), job.result_text);
    if (["done", "dead", "cancelled", "expired"].indexOf(job.state) >= 0) {
      source.close();
      text(document.getElementById("job-lease"), "-");
      const cancel = document.getElementById("job-cancel");
      if (cancel) cancel.closest("form").hidden = true;
    }
  });
  // The broker unreachable (its state and progress are stale), or back (an empty list).
  source.addEventListener("problems", function (ev) { setBanners(JSON.parse(ev.data).problems); });
  source.onerror = function () { stopped(source); };
  source.addEventListener("gone", function () {
    source.close();
    setBanners(["This job no longer exists (deleted or pruned)."]);
  });
}

function matchCount() {
  const box = document.getElementById("match-count");
  if (!box || !box.dataset.countUrl) return;
  box.textContent = "counting…";
  fetch(box.dataset.countUrl, {credentials: "same-origin"})
    .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
    .then(function (c) {
      // An estimate is scaled from the jobs a bounded count checked: say so, "about 0" alone misleads.
      box.textContent = (c.exact ? "" : "about ") + c.count + " matching job" + (c.count === 1 ? "" : "s") +
        (c.exact ? "" : " (estimated from the jobs checked)");
    })
    .catch(function () { box.textContent = ""; });
}

document.addEventListener("DOMContentLoaded", function () {
  confirmations();
  matchCount();
  const page = document.body.dataset.page;
  if (page === "overview") overview();
  if (page === "job") jobPage();
});

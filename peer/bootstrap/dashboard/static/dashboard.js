/* peer dashboard: fetches /api/… and builds the page with textContent only (never innerHTML), so
 * nothing a peer publishes can become markup. Charts: the vendored Chart.js (chart.min.js). Each
 * chart's canvas says what it drew in data-points (points) and data-rounds (distinct outer steps);
 * <body data-ready> is set after the first paint, with data-first-paint-ms (performance.now()). */
"use strict";
(function () {
  const REFRESH_MS = 2000;
  const charts = {};
  const peerMatch = /^\/peers\/(.+)$/.exec(window.location.pathname);
  let peerId = null;
  try { peerId = peerMatch ? decodeURIComponent(peerMatch[1]) : null; } catch (e) { peerId = peerMatch[1]; }

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }
  function fmt(v, digits) {
    if (v === null || v === undefined) return "—";
    if (typeof v === "number") return digits === undefined ? String(v) : v.toFixed(digits);
    return String(v);
  }
  function short(id) { return id ? String(id).slice(0, 16) : "—"; }
  function duration(s) {
    if (s === null || s === undefined) return "—";
    if (s < 120) return s.toFixed(0) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function peerLink(id) {
    const a = el("a", short(id), "id");
    a.href = "/peers/" + encodeURIComponent(id);
    a.title = String(id);
    return a;
  }
  /* cells: a string/number, a Node, or {text, cls} */
  function fillBody(tbody, rows) {
    const frag = document.createDocumentFragment();
    for (const row of rows) {
      const tr = document.createElement("tr");
      row.forEach(function (cell, i) {
        const td = el(i === 0 && row.header ? "th" : "td");
        if (i === 0 && row.header) td.scope = "row";
        if (cell instanceof Node) td.appendChild(cell);
        else if (cell && typeof cell === "object") { td.textContent = fmt(cell.text); if (cell.cls) td.className = cell.cls; }
        else { td.textContent = fmt(cell); if (typeof cell === "number") td.className = "num"; }
        tr.appendChild(td);
      });
      frag.appendChild(tr);
    }
    tbody.replaceChildren(frag);
  }
  function fillHead(thead, names) {
    const tr = document.createElement("tr");
    for (const name of names) { const th = el("th", name); th.scope = "col"; tr.appendChild(th); }
    thead.replaceChildren(tr);
  }
  function keyValues(tbody, pairs) {
    const rows = pairs.map(function (p) { const r = [p[0], p[1]]; r.header = true; return r; });
    fillBody(tbody, rows);
  }
  function table(caption, names, rows, id) {
    const t = el("table");
    if (id) t.id = id;
    t.appendChild(el("caption", caption));
    const thead = el("thead"), tbody = el("tbody");
    fillHead(thead, names);
    fillBody(tbody, rows);
    t.appendChild(thead);
    t.appendChild(tbody);
    return t;
  }

  function drawChart(id, datasets, xTitle, yTitle) {
    const canvas = document.getElementById(id);
    let points = 0;
    const ts = new Set();
    for (const d of datasets) for (const p of d.data) { points += 1; ts.add(p.x); }
    canvas.dataset.points = String(points);
    canvas.dataset.rounds = String(ts.size);
    if (typeof window.Chart === "undefined") { canvas.dataset.drawn = "no"; return; }
    if (charts[id]) {
      charts[id].data.datasets = datasets;
      charts[id].update("none");
    } else {
      charts[id] = new window.Chart(canvas, {
        type: "line",
        data: { datasets: datasets },
        options: {
          animation: false, responsive: true, maintainAspectRatio: false, parsing: false, normalized: true,
          spanGaps: true,
          scales: {
            x: { type: "linear", title: { display: true, text: xTitle, color: "#111" }, ticks: { color: "#111" } },
            y: { title: { display: true, text: yTitle, color: "#111" }, ticks: { color: "#111" } },
          },
          plugins: { legend: { labels: { color: "#111", boxWidth: 12 } } },
        },
      });
    }
    canvas.dataset.drawn = "yes";
  }
  function xy(points, xi, yi) {
    const out = [];
    for (const p of points) if (p[yi] !== null && p[xi] !== null) out.push({ x: p[xi], y: p[yi] });
    return out;
  }
  const BLUES = ["#1f4e9c", "#3a75c4", "#123366", "#5b8fd6"], ORANGES = ["#b35900", "#d9822b", "#7a3d00", "#e8a05c"];
  function lossDatasets(replicas, mean) {
    const sets = [];
    let nb = 0, no = 0;
    for (const r of replicas) {
      const full = r.kind === "full";
      const color = full ? ORANGES[no++ % ORANGES.length] : BLUES[nb++ % BLUES.length];
      const name = (full ? "full " : "pipeline ") + short(r.replica);
      sets.push({ label: name + " train", data: xy(r.points, 0, 1), borderColor: color, backgroundColor: color, pointRadius: 2 });
      sets.push({ label: name + " val", data: xy(r.points, 0, 2), borderColor: color, backgroundColor: color, borderDash: [6, 4], pointRadius: 2 });
    }
    if (mean) sets.push({ label: "replica-mean val", data: xy(mean, 0, 1), borderColor: "#000", backgroundColor: "#000", borderWidth: 3, pointRadius: 0 });
    return sets;
  }

  function renderRun(run) {
    document.getElementById("title").textContent = "peer run " + fmt(run.run_id);
    keyValues(document.querySelector("#run-table tbody"), [
      ["run id", run.run_id], ["model", fmt(run.preset) + " (d_model " + fmt(run.d_model) + ", " + fmt(run.n_layers) + " layers)"],
      ["stages", run.stages], ["k / d", fmt(run.k_ratio) + " (k = " + fmt(run.k) + ")"], ["H (inner steps)", run.inner_steps],
      ["outer step", fmt(run.outer_step) + " of " + fmt(run.outer_steps)], ["tokens/s (all replicas)", fmt(run.tokens_per_s, 0)],
      ["admission", run.admission], ["dashboard up", duration(run.uptime_s)], ["failed reads", run.poll_failures],
    ]);
    const series = run.tokens_per_s_series;
    const t0 = series.length ? series[0][0] : 0;
    drawChart("tokens-chart", [{ label: "tokens/s", data: series.map(function (p) { return { x: p[0] - t0, y: p[1] }; }), borderColor: "#1f4e9c", pointRadius: 0 }], "seconds", "tokens/s");
    drawChart("steps-chart", [{ label: "wall s per outer step", data: xy(run.step_wall_s_series, 0, 1), borderColor: "#7a3d00", pointRadius: 2 }], "outer step", "seconds");
  }
  function renderLoss(loss) {
    drawChart("loss-chart", lossDatasets(loss.replicas, loss.mean_val), "outer step", "loss");
    const names = ["outer step"];
    for (const r of loss.replicas) names.push((r.kind === "full" ? "full " : "pipeline ") + short(r.replica) + " train", "val");
    names.push("replica-mean val");
    fillHead(document.querySelector("#loss-table thead"), names);
    const byT = new Map();
    loss.replicas.forEach(function (r, i) { for (const p of r.points) { if (!byT.has(p[0])) byT.set(p[0], {}); byT.get(p[0])[i] = p; } });
    const mean = new Map(loss.mean_val.map(function (p) { return [p[0], p[1]]; }));
    const rows = Array.from(byT.keys()).sort(function (a, b) { return a - b; }).map(function (t) {
      const row = [t];
      loss.replicas.forEach(function (r, i) { const p = byT.get(t)[i]; row.push(p ? fmt(p[1], 4) : "—", p ? fmt(p[2], 4) : "—"); });
      row.push(fmt(mean.has(t) ? mean.get(t) : null, 4));
      return row;
    });
    fillBody(document.querySelector("#loss-table tbody"), rows);
  }
  function agreementText(a) { return a === null ? "not yet" : a ? "yes" : "no"; }
  function renderStages(stages) {
    const frag = document.createDocumentFragment();
    for (const st of stages) {
      const section = el("section");
      section.id = "stage-" + st.stage;
      section.className = "stage";
      const speed = Math.round(st.tokens_per_s).toLocaleString("en-US");
      section.appendChild(el("h3", "Stage " + st.stage + " — " + st.holders.length + " holder(s), " + speed + " tokens/s, agreement: " + agreementText(st.agreement)));
      const rows = st.holders.map(function (h) {
        return [peerLink(h.peer_id), h.mode ? h.role + " (" + h.mode + ")" : h.role, h.state, h.outer_step, { text: short(h.state_id), cls: "id" },
          { text: h.agrees === null ? "—" : h.agrees ? "yes" : "no", cls: h.agrees === false ? "bad" : h.agrees ? "good" : "" },
          h.tokens_per_s === null ? null : Math.round(h.tokens_per_s), h.connectivity];
      });
      section.appendChild(table("Holders of stage " + st.stage, ["peer", "role", "state", "outer step", "state id", "agrees", "tokens/s", "link"], rows));
      const rounds = st.rounds.map(function (r) {
        return [r.t, r.holders, r.state_ids, { text: r.agree ? "yes" : "no", cls: r.agree ? "good" : "bad" }];
      });
      section.appendChild(table("Agreement of stage " + st.stage + " over its last outer steps", ["outer step", "holders", "distinct state ids", "agreement"], rounds));
      frag.appendChild(section);
    }
    document.getElementById("stages").replaceChildren(frag);
  }
  function renderPeers(peers) {
    fillHead(document.querySelector("#peers-table thead"), ["peer", "role", "stage", "outer step", "rounds", "tokens", "uptime", "online"]);
    fillBody(document.querySelector("#peers-table tbody"), peers.map(function (p) {
      return [peerLink(p.peer_id), p.role, p.stage, p.outer_step, p.rounds, p.tokens, duration(p.uptime_s), p.live ? "yes" : "no"];
    }));
  }
  function renderPeer(p) {
    document.getElementById("title").textContent = "peer " + short(p.peer_id);
    document.getElementById("peer-heading").textContent = "Peer " + p.peer_id;
    const pairs = [["peer id", p.peer_id], ["role", p.role], ["stage", p.stage], ["outer step", p.outer_step],
      ["rounds (outer steps advanced)", p.rounds], ["tokens (estimated)", p.tokens], ["uptime", duration(p.uptime_s)],
      ["last seen", duration(p.last_seen_s_ago) + " ago"], ["online", p.live ? "yes" : "no"]];
    if (p.replica) pairs.push(["replica", fmt(p.replica.kind) + ", loss " + fmt(p.replica.loss, 4) + ", shard " + fmt(p.replica.shard)]);
    keyValues(document.querySelector("#peer-table tbody"), pairs);
    fillHead(document.querySelector("#peer-stages thead"), ["stage", "role", "state", "outer step", "state id", "tokens/s"]);
    fillBody(document.querySelector("#peer-stages tbody"), p.stages.map(function (s) {
      return [s.stage, s.role, s.state, s.outer_step, { text: short(s.state_id), cls: "id" }, s.tokens_per_s === null ? null : Math.round(s.tokens_per_s)];
    }));
    drawChart("peer-loss-chart", lossDatasets([{ replica: p.peer_id, kind: p.replica ? p.replica.kind : p.role, points: p.loss }], null), "outer step", "loss");
  }

  async function refresh() {
    const status = document.getElementById("status");
    try {
      const url = peerId === null ? "/api/dashboard" : "/api/peers/" + encodeURIComponent(peerId);
      const answer = await fetch(url, { cache: "no-store" });
      if (answer.status === 404) { status.textContent = "No peer " + peerId + " has been seen."; status.setAttribute("role", "alert"); return; }
      if (!answer.ok) throw new Error("HTTP " + answer.status);
      const data = await answer.json();
      if (peerId === null) {
        renderRun(data.run); renderLoss(data.loss); renderStages(data.stages); renderPeers(data.peers);
        status.textContent = "Updated " + new Date().toLocaleTimeString() + " (every " + REFRESH_MS / 1000 + " s).";
        status.removeAttribute("role");
      } else {
        document.getElementById("overview").hidden = true;
        document.getElementById("peer-page").hidden = false;
        renderPeer(data);
        status.textContent = "Updated " + new Date().toLocaleTimeString() + ".";
      }
      if (!document.body.dataset.ready) {
        document.body.dataset.firstPaintMs = performance.now().toFixed(1);
        document.body.dataset.ready = "1";
      }
    } catch (err) {
      status.textContent = "Could not read the run: " + err.message + " (retrying).";
      status.setAttribute("role", "alert");  /* errors are announced; the every-2-s "Updated" line is not */
    }
  }
  refresh();
  setInterval(refresh, REFRESH_MS);
})();

"use strict";
(function () {
  const cfg = JSON.parse(document.body.dataset.config);
  const token = new URLSearchParams(location.search).get("token");
  const headers = token ? {"Authorization": "Bearer " + token} : {};
  const SVG = "http://www.w3.org/2000/svg";
  let refreshes = 0;

  function dash(v) { return v === null || v === undefined || v === "" ? "-" : String(v); }
  function human(n) {
    if (n === null || n === undefined) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    for (let i = 0; i < units.length; i++) {
      if (Math.abs(n) < 1024 || i === units.length - 1)
        return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + units[i];
      n /= 1024;
    }
  }
  function clock(t) { return new Date(t * 1000).toISOString().slice(11, 19); }
  function node(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }
  function setText(id, text) { document.getElementById(id).textContent = text; }
  function fill(id, children) { document.getElementById(id).replaceChildren(...children); }

  function peerRow(p) {
    const member = p.state === "accepted" || p.state === "resuming";
    const tr = node("tr", undefined, p.stale ? "peer stale" : "peer");
    tr.dataset.peerId = dash(p.peer_id);
    tr.dataset.rank = dash(member ? p.rank : null);
    tr.append(node("td", p.peer_id || "(connecting)", "id"), node("td", dash(p.address)),
              node("td", dash(member ? p.rank : null), "rank"), node("td", dash(p.state), "state"),
              node("td", p.heartbeat_age_s.toFixed(1) + " s", p.stale ? "age stale" : "age"),
              node("td", dash(p.step), "num"), node("td", human(p.bytes_sent), "num"),
              node("td", human(p.bytes_received), "num"), node("td", dash(p.op)));
    return tr;
  }

  function bandwidth(bw) {
    const section = document.getElementById("bandwidth-section");
    section.hidden = bw === null;
    if (bw === null) { fill("bandwidth", []); return; }
    const head = node("tr");
    head.append(node("th", "from \\ to"), ...bw.peer_ids.map(id => node("th", dash(id))));
    const thead = node("thead"); thead.append(head);
    const tbody = node("tbody");
    bw.matrix.forEach((row, i) => {
      const tr = node("tr");
      tr.append(node("th", dash(i < bw.peer_ids.length ? bw.peer_ids[i] : i)),
                ...row.map(v => node("td", v === null ? "-" : (v / 1e6).toFixed(1), "num")));
      tbody.append(tr);
    });
    fill("bandwidth", [thead, tbody]);
  }

  function quorum(q) {
    document.getElementById("quorum-section").hidden = !q.open && !q.closed.length;
    const r = q.open;
    setText("quorum-open", r ? "round " + r.round + " open: ready " +
            (r.ready.join(", ") || "none") + "; waiting for " + (r.waiting.join(", ") ||
            "none") + " (at least " + r.min_peers + ", grace " + r.grace_s + " s)"
            : "no round open");
    const head = node("tr");
    head.append(node("th", "round"), node("th", "participants (tokens)"), node("th", "late"),
                node("th", "closed after"));
    const thead = node("thead"); thead.append(head);
    const tbody = node("tbody");
    for (const c of q.closed.slice().reverse()) {
      const tr = node("tr");
      tr.dataset.round = String(c.round);
      tr.append(node("td", String(c.round), "num"),
                node("td", c.peer_ids.map((id, i) => id + " (" + c.tokens[i] + ")").join(", "),
                     "participants"),
                node("td", dash(c.late.join(", ")), "late"),
                node("td", c.seconds.toFixed(2) + " s", "num"));
      tbody.append(tr);
    }
    fill("quorum", [thead, tbody]);
  }

  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function chart(history) {
    const g = cfg.chart;
    const iw = g.w - g.left - g.right, ih = g.h - g.top - g.bottom;
    const parts = [svg("rect", {class: "frame", x: g.left, y: g.top, width: iw, height: ih})];
    if (history.length) {
      const t0 = history[0].time, t1 = history[history.length - 1].time;
      const span = Math.max(t1 - t0, 1e-9);
      const maxWs = Math.max(1, ...history.map(h => h.world_size));
      const maxBw = Math.max(1, ...history.map(h => h.bytes_per_s));
      const line = (key, top) => history.map(h =>
        (g.left + iw * (h.time - t0) / span).toFixed(1) + "," +
        (g.top + ih * (1 - h[key] / top)).toFixed(1)).join(" ");
      parts.push(svg("polyline", {class: "ws", points: line("world_size", maxWs)}),
                 svg("polyline", {class: "bw", points: line("bytes_per_s", maxBw)}));
      const labels = [[g.left - 4, g.top + 10, "end", "ws", String(maxWs)],
                      [g.left - 4, g.top + ih, "end", "ws", "0"],
                      [g.w - g.right + 4, g.top + 10, "start", "bw", human(maxBw) + "/s"],
                      [g.left, g.h - 6, "start", "", "last " + span.toFixed(0) + " s"],
                      [g.w - g.right - 80, g.h - 6, "end", "ws", "world size"],
                      [g.w - g.right, g.h - 6, "end", "bw", "throughput"]];
      for (const [x, y, anchor, cls, text] of labels)
        parts.push(svg("text", {class: cls, x: x, y: y, "text-anchor": anchor}, text));
    }
    fill("chart", parts);
  }

  function render(s) {
    setText("comm-id", s.comm_id);
    setText("epoch", dash(s.epoch));
    setText("world-size", dash(s.world_size));
    setText("ring-order", dash(s.ring_order.join(" \u2192 ")));
    setText("master-address", dash(s.master.address));
    setText("uptime", s.master.uptime_s.toFixed(0) + " s");
    fill("peers", s.peers.map(peerRow));
    fill("pending", s.pending.length ? s.pending.map(id => node("li", dash(id)))
                                     : [node("li", "none")]);
    setText("shared-revision", dash(s.shared_state.revision));
    setText("shared-digest", dash(s.shared_state.content));
    setText("restart", s.restart.summary);
    quorum(s.quorum);
    bandwidth(s.bandwidth);
    chart(s.history);
    fill("events", s.events.slice(-cfg.maxEvents).reverse().map(ev => {
      const li = node("li");
      li.append(node("time", clock(ev.time)), document.createTextNode(" " + ev.text));
      return li;
    }));
    const c = s.counters;
    const drops = Object.keys(c.drops).sort().map(k => k + " " + c.drops[k]).join(", ");
    setText("counters", "joins " + c.joins + "; drops: " + (drops || "none") +
            "; update rounds " + c.update_rounds + "; sync rounds " + c.sync_rounds +
            "; resumes " + c.resumes);
  }

  async function refresh() {
    const conn = document.getElementById("conn");
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), cfg.fetchTimeoutMs);
    try {
      const r = await fetch("api/status", {headers: headers, cache: "no-store",
                                           signal: abort.signal});
      if (!r.ok) throw new Error("HTTP " + r.status);
      render(await r.json());
      refreshes += 1;
      document.body.dataset.refreshes = String(refreshes);
      conn.textContent = "live, updated " + new Date().toISOString().slice(11, 19) + " UTC";
      conn.className = "";
    } catch (e) {
      conn.textContent = "not updating: " + e.message;
      conn.className = "error";
    } finally {
      clearTimeout(timer);
      setTimeout(refresh, cfg.refreshMs);
    }
  }
  refresh();
})();

// kvreuse live cache dashboard: polls GET v1/cache/dashboard and draws it.
//
// The page holds no data of its own. The API key comes from the URL fragment (#key=..., which the
// browser never sends to the server) or the key field, lives in sessionStorage, and goes out as
// "Authorization: Bearer" on the JSON fetches only. Every string from the server (prompt text above
// all) is put in the page with textContent, never parsed as HTML.
"use strict";

(() => {
  const KEY_STORAGE = "kvreuse.dashboard.key";
  const TEXT_LIMIT = 600; // characters of a subtree's text shown in the table (the rest in its tooltip)
  const NEEDS_KEY = "This server needs an API key: add #key=YOUR_KEY to the address or paste it in the key field above.";
  const COLORS = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#65a30d", "#db2777"];

  const page = {
    config: null,
    key: null,
    timer: null,
    generation: 0, // a new key starts a new polling chain; replies of the old one are dropped
    views: new Map(), // view name -> {root, roles}
  };

  // --- helpers ------------------------------------------------------------------------------------
  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function fmtInt(value) {
    return typeof value === "number" ? Math.round(value).toLocaleString("en-US") : "–";
  }

  function fmtRate(value) {
    return typeof value === "number" ? (100 * value).toFixed(1) + "%" : "–";
  }

  function fmtSeconds(value) {
    if (typeof value !== "number") return "none";
    if (value >= 3600) return (value / 3600).toFixed(1) + " h";
    if (value >= 60) return (value / 60).toFixed(1) + " min";
    return value.toFixed(0) + " s";
  }

  function clip(text, limit) {
    const value = String(text ?? "");
    return value.length > limit ? value.slice(0, limit) + "…" : value;
  }

  function ownerLabel(owner, scope) {
    if (owner === null || owner === undefined || owner === "" || owner === "shared") return "shared";
    const short = String(owner).slice(0, 8);
    return scope && scope.tenant === owner ? "you (" + short + ")" : "tenant " + short;
  }

  function setStatus(text, kind) {
    const status = document.getElementById("status");
    status.textContent = text;
    status.className = "status " + (kind || "");
  }

  function showNotice(text) {
    const notice = document.getElementById("notice");
    notice.textContent = text;
    notice.hidden = !text;
  }

  // --- the key --------------------------------------------------------------------------------------
  function takeKeyFromFragment() {
    const match = /(?:^|[#&])key=([^&]*)/.exec(location.hash);
    if (match) {
      sessionStorage.setItem(KEY_STORAGE, decodeURIComponent(match[1]));
      // Drop it from the address bar (and from screenshots, history entries and shared links).
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem(KEY_STORAGE);
  }

  function useKey(key) {
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    page.key = key || null;
    restart();
  }

  // --- polling --------------------------------------------------------------------------------------
  function restart() {
    page.generation += 1;
    clearTimeout(page.timer);
    if (page.config && page.config.auth_required && !page.key) {
      needKey(NEEDS_KEY);
      return;
    }
    poll(page.generation);
  }

  function needKey(message) {
    showNotice(message);
    setStatus("no key", "warn");
    for (const view of page.views.values()) view.root.remove();
    page.views.clear();
  }

  async function poll(generation) {
    let next = page.config ? page.config.poll_ms : 1500;
    let response = null;
    let data = null;
    try {
      const headers = {Accept: "application/json"};
      if (page.key) headers.Authorization = "Bearer " + page.key;
      response = await fetch("v1/cache/dashboard", {headers, cache: "no-store"});
      if (response.ok) data = await response.json();
    } catch (error) {
      response = null; // the server is down or restarting: keep trying, a little slower
    }
    if (generation !== page.generation) return;
    if (response === null) {
      setStatus("server unreachable, retrying", "warn");
      next = Math.max(next, 3000);
    } else if (response.status === 401 || response.status === 403) {
      needKey(page.key ? "The server refused this key (HTTP " + response.status + "): paste another one above."
                       : NEEDS_KEY);
      return;
    } else if (!response.ok || data === null) {
      setStatus("server answered " + response.status + ", retrying", "warn");
    } else {
      try {
        if (!render(data)) return; // it asked for a key: no polling without one
        setStatus("live · " + new Date().toLocaleTimeString(), "ok");
      } catch (error) {
        console.error("kvreuse dashboard: drawing the reply failed", error); // a bug here, not the server's
        setStatus("drawing failed, retrying", "warn");
      }
    }
    page.timer = setTimeout(() => poll(generation), next);
  }

  // --- rendering ------------------------------------------------------------------------------------
  // Draws one reply; false when the page cannot show anything without another key.
  function render(data) {
    if (data.object === "router.dashboard") {
      document.getElementById("where").textContent = "router over " + (data.backends || []).length + " backend(s)";
      if (data.auth_required) {
        needKey(page.key ? "The backends refused this key: paste another one above."
                         : NEEDS_KEY);
        return false;
      }
      const keep = new Set();
      for (const backend of data.backends || []) {
        keep.add(backend.url);
        const view = viewFor(backend.url, "backend " + backend.url);
        if (backend.status === "ok" && backend.dashboard) {
          showDown(view, null);
          renderServer(view, backend.dashboard);
        } else {
          showDown(view, describeBackendProblem(backend));
        }
      }
      dropViewsExcept(keep);
      showNotice("");
      return true;
    }
    showNotice("");
    dropViewsExcept(new Set(["server"]));
    const view = viewFor("server", null);
    renderServer(view, data);
    document.getElementById("where").textContent = describeScope(data);
    return true;
  }

  function describeBackendProblem(backend) {
    if (backend.status === "down") return "down: " + (backend.error || "not answering");
    if (backend.status === "unauthorized") return "this backend needs an API key the page does not have (or refused it)";
    return "unavailable: " + (backend.error || backend.status);
  }

  function describeScope(data) {
    const scope = data.scope || {};
    const who = scope.sees_all ? (scope.tenant ? "admin: all tenants" : "all tenants") : ownerLabel(scope.tenant, scope);
    return (data.model ? data.model + " · " : "") + who;
  }

  function viewFor(name, title) {
    let view = page.views.get(name);
    if (view) return view;
    const fragment = document.getElementById("view-template").content.cloneNode(true);
    const root = fragment.querySelector(".view");
    const roles = {};
    for (const node of root.querySelectorAll("[data-role]")) roles[node.dataset.role] = node;
    if (title) {
      roles.title.textContent = title;
      roles.title.hidden = false;
    }
    document.getElementById("views").appendChild(root);
    view = {root, roles};
    page.views.set(name, view);
    return view;
  }

  function dropViewsExcept(keep) {
    for (const [name, view] of page.views) {
      if (!keep.has(name)) {
        view.root.remove();
        page.views.delete(name);
      }
    }
  }

  function showDown(view, message) {
    view.roles.down.textContent = message || "";
    view.roles.down.hidden = !message;
    view.roles.body.hidden = Boolean(message);
  }

  function renderServer(view, data) {
    const roles = view.roles;
    const scope = data.scope || {};
    const rates = data.hit_rate || {};
    const mine = rates.total || sumOwners(rates.owners || {});
    roles["hit-rate"].textContent = fmtRate(mine.hit_rate);
    roles["hit-rate-sub"].textContent = fmtInt(mine.hit_tokens) + " of " + fmtInt(mine.query_tokens) + " prompt tokens";
    roles["recent-hit-rate"].textContent = fmtRate(mine.recent_hit_rate);
    roles["recent-sub"].textContent = "last " + fmtInt(rates.window_s) + " s";
    roles["tokens-saved"].textContent = fmtInt(mine.hit_tokens);
    const blocks = data.blocks || {};
    roles["blocks-used"].textContent = fmtInt(blocks.in_use) + " / " + fmtInt(blocks.total);
    roles["blocks-sub"].textContent = fmtInt(blocks.idle) + " idle cached · " + fmtInt(blocks.free) + " free · " +
      fmtInt(blocks.pinned) + " pinned";
    const requests = data.requests || {};
    roles.requests.textContent = fmtInt(requests.running) + " / " + fmtInt(requests.waiting);
    drawCharts(roles, data, scope);
    fillTree(roles.tree, data.tree || [], scope);
    fillPins(roles.pins, data.pins || [], scope);
    fillDrift(roles.drift, data.drift, scope);
    fillTiers(roles, data.tiers);
  }

  function sumOwners(owners) {
    const total = {query_tokens: 0, hit_tokens: 0, hit_rate: null, recent_hit_rate: null};
    const entries = Object.values(owners);
    for (const owner of entries) {
      total.query_tokens += owner.query_tokens || 0;
      total.hit_tokens += owner.hit_tokens || 0;
    }
    if (total.query_tokens) total.hit_rate = total.hit_tokens / total.query_tokens;
    if (entries.length === 1) total.recent_hit_rate = entries[0].recent_hit_rate;
    return total;
  }

  // --- charts (plotly.js, served by the server itself) ------------------------------------------------
  const PLOT_CONFIG = {displayModeBar: false, responsive: true};

  function baseLayout(title, yTitle) {
    return {
      title: {text: title, font: {size: 14}}, height: 260, margin: {l: 55, r: 15, t: 40, b: 40},
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#fafafa", showlegend: true,
      legend: {orientation: "h", y: -0.2}, yaxis: {title: {text: yTitle}, rangemode: "tozero"},
      xaxis: {type: "date"}, uirevision: "keep", // zoom and hidden traces survive the updates
    };
  }

  function seriesTraces(series, scope, field, scale) {
    const x = (series.time || []).map((t) => new Date(t * 1000));
    const traces = [];
    const scaled = (values) => values.map((v) => (typeof v === "number" ? v * scale : null));
    if (series.total) {
      traces.push({x, y: scaled(series.total[field]), name: "all tenants", mode: "lines",
                   line: {color: "#111827", width: 3}});
    }
    const owners = Object.entries(series.owners || {});
    // A server without keys has one owner, "shared": its line would repeat the total's.
    if (series.total && owners.length === 1 && owners[0][0] === "shared") return traces;
    owners.forEach(([owner, values], index) => {
      traces.push({x, y: scaled(values[field]), name: ownerLabel(owner, scope), mode: "lines",
                   line: {color: COLORS[index % COLORS.length], width: 2}, connectgaps: false});
    });
    return traces;
  }

  function drawCharts(roles, data, scope) {
    if (typeof Plotly === "undefined") return; // the script failed to load: the tables still work
    const series = data.series || {};
    const rateLayout = baseLayout("Hit rate (last " + fmtInt(series.window_s) + " s)", "%");
    rateLayout.yaxis.range = [0, 100];
    rateLayout.yaxis.rangemode = undefined;
    Plotly.react(roles["chart-hit-rate"], seriesTraces(series, scope, "hit_rate", 100), rateLayout, PLOT_CONFIG);
    Plotly.react(roles["chart-saved"], seriesTraces(series, scope, "tokens_saved", 1),
                 baseLayout("Tokens saved (cached prompt tokens)", "tokens"), PLOT_CONFIG);
    // Block states over time: in use and idle (cached) stacked, pinned as a line (a part of those);
    // free blocks are the rest of the pool (the card shows them), left out so small counts stay visible.
    const blocks = series.blocks || {};
    const x = (series.time || []).map((t) => new Date(t * 1000));
    const traces = [
      {x, y: blocks.in_use || [], name: "in use", stackgroup: "pool", line: {color: "#f59e0b"}},
      {x, y: blocks.idle || [], name: "idle (cached)", stackgroup: "pool", line: {color: "#60a5fa"}},
    ];
    if (blocks.pinned) traces.push({x, y: blocks.pinned, name: "pinned", mode: "lines", line: {color: "#a855f7", width: 2}});
    Plotly.react(roles["chart-blocks"], traces, baseLayout("KV blocks (of " + fmtInt((data.blocks || {}).total) + ")",
                                                           "blocks"), PLOT_CONFIG);
  }

  // --- tables ---------------------------------------------------------------------------------------
  function row(cells) {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      if (cell instanceof Node) {
        const td = document.createElement("td");
        td.appendChild(cell);
        tr.appendChild(td);
      } else {
        tr.appendChild(el("td", cell));
      }
    }
    return tr;
  }

  function emptyRow(tbody, columns, text) {
    const td = el("td", text, "muted");
    td.colSpan = columns;
    const tr = document.createElement("tr");
    tr.appendChild(td);
    tbody.replaceChildren(tr);
  }

  function fillTree(tbody, entries, scope) {
    if (!entries.length) return emptyRow(tbody, 6, "nothing cached yet");
    tbody.replaceChildren(...entries.map((entry) => {
      const text = el("code", clip(entry.text, TEXT_LIMIT), "prompt");
      text.title = String(entry.text ?? "");
      return row([text, fmtInt(entry.tokens), fmtInt(entry.blocks), fmtInt(entry.hits),
                  entry.pinned ? "yes" : "", ownerLabel(entry.namespace_owner, scope)]);
    }));
  }

  function fillPins(tbody, pins, scope) {
    if (!pins.length) return emptyRow(tbody, 7, "no pins");
    tbody.replaceChildren(...pins.map((pin) => row([
      el("code", pin.id), pin.kind, fmtInt(pin.tokens), fmtInt(pin.blocks), fmtInt(pin.hits),
      pin.ttl === null || pin.ttl === undefined ? "no TTL" : fmtSeconds(pin.ttl_left_s), ownerLabel(pin.owner, scope),
    ])));
  }

  function fillDrift(container, drift, scope) {
    if (!drift || !Array.isArray(drift.groups)) {
      container.replaceChildren(el("p", "no drift report", "muted"));
      return;
    }
    const parts = [el("p", fmtInt(drift.recorded_misses) + " recent partial misses in " + fmtInt(drift.num_groups) +
                      " group(s), " + fmtInt(drift.tokens_lost) + " tokens recomputed that a stable prompt would have reused",
                      "muted")];
    if (!drift.groups.length) parts.push(el("p", "no misses recorded", "muted"));
    // Groups that lose nothing diverge where prompts really differ (most often where the user's turn
    // starts): expected, so they are folded away below the ones worth acting on.
    const costly = drift.groups.filter((group) => group.tokens_lost_per_request > 0);
    const expected = drift.groups.filter((group) => !(group.tokens_lost_per_request > 0));
    for (const group of costly) parts.push(driftGroup(group, scope));
    if (expected.length) {
      const details = el("details", null, "drift-expected");
      const before = container.querySelector("details.drift-expected");
      details.open = Boolean(before && before.open); // a poll must not fold what the reader opened
      details.appendChild(el("summary", expected.length + " group(s) diverging where the prompts really differ " +
                                        "(no tokens lost: expected where the user's part starts)"));
      for (const group of expected) details.appendChild(driftGroup(group, scope));
      parts.push(details);
    }
    container.replaceChildren(...parts);
  }

  function driftGroup(group, scope) {
    const box = el("div", null, "drift-group");
    box.appendChild(el("p", group.sentence, "headline"));
    const facts = el("dl");
    const fact = (name, value) => {
      facts.appendChild(el("dt", name));
      const dd = el("dd");
      if (value instanceof Node) dd.appendChild(value);
      else dd.textContent = value;
      facts.appendChild(dd);
    };
    const positions = Array.isArray(group.positions) && group.positions.length > 1
      ? "tokens " + group.positions.slice(0, 6).map(fmtInt).join(", ") + (group.positions.length > 6 ? ", …" : "")
      : "token " + fmtInt(group.position);
    fact("requests", fmtInt(group.requests) + " · diverging at " + positions + " · " +
         fmtInt(group.tokens_lost_per_request) + " tokens lost each");
    fact("prefix starts", el("code", group.template, "prompt"));
    fact("text before", el("code", clip(group.before, TEXT_LIMIT), "prompt"));
    fact("cached text", el("code", group.cached_text, "prompt"));
    fact("this request", el("code", group.request_text, "prompt"));
    if (Array.isArray(group.volatile) && group.volatile.length) {
      fact("volatile", group.volatile.map((span) => span.kind + " " + JSON.stringify(span.text) + " (" + span.side + ")")
                                     .join(", "));
    }
    if (group.tools && Array.isArray(group.tools.summary) && group.tools.summary.length) {
      // Inside a tool list: which tool changed (and the JSON path), came, went or moved.
      const list = el("ul");
      for (const line of group.tools.summary) list.appendChild(el("li", line));
      fact("tools", list);
    }
    if (Array.isArray(group.advice) && group.advice.length) {
      const list = el("ul");
      for (const line of group.advice) list.appendChild(el("li", line));
      fact("advice", list);
    }
    fact("owner", ownerLabel(group.namespace_owner, scope));
    if (typeof group.last_seen === "number") fact("last seen", new Date(group.last_seen * 1000).toLocaleTimeString());
    box.appendChild(facts);
    return box;
  }

  function fmtMiB(bytes) {
    return typeof bytes === "number" ? (bytes / 1048576).toFixed(1) + " MiB" : "–";
  }

  const TIER_COLUMNS = [
    ["lookups", (t) => fmtInt(t.queries)],
    ["hits", (t) => fmtInt(t.hits)],
    ["hit rate", (t) => (t.queries ? fmtRate(t.hits / t.queries) : "–")],
    ["loaded", (t) => fmtMiB(t.hit_bytes)],
    ["blocks stored", (t) => fmtInt(t.stores)],
    ["stored", (t) => fmtMiB(t.store_bytes)],
    ["load time", (t) => (typeof t.load_seconds === "number" ? t.load_seconds.toFixed(2) + " s" : "–")],
    ["verify failures", (t) => fmtInt(Object.values(t.verify_failures || {}).reduce((a, b) => a + b, 0))],
  ];

  function fillTiers(roles, tiers) {
    const names = tiers ? Object.keys(tiers) : [];
    roles["tiers-section"].hidden = !names.length;
    if (!names.length) return;
    const head = document.createElement("tr");
    for (const title of ["tier", ...TIER_COLUMNS.map(([name]) => name)]) head.appendChild(el("th", title));
    roles["tiers-head"].replaceChildren(head);
    roles.tiers.replaceChildren(...names.map((name) => row([name, ...TIER_COLUMNS.map(([, show]) => show(tiers[name] || {}))])));
  }

  // --- start ----------------------------------------------------------------------------------------
  async function start() {
    page.key = takeKeyFromFragment();
    document.getElementById("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = document.getElementById("key-input");
      const key = input.value.trim();
      input.value = "";
      useKey(key);
    });
    document.getElementById("key-forget").addEventListener("click", () => useKey(null));
    window.addEventListener("hashchange", () => {
      const key = takeKeyFromFragment();
      if (key !== page.key) useKey(key);
    });
    try {
      const response = await fetch("dashboard/config.json", {cache: "no-store"});
      page.config = await response.json();
    } catch (error) {
      page.config = {auth_required: false, poll_ms: 1500};
    }
    restart();
  }

  start();
})();

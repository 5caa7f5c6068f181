// One study: Pareto front, history, memory, calibration, regions, importances, a trial's curve,
// the trials. The page opens with everything but the importances, which arrive after (the
// server's first importances after a start import Optuna's evaluators: seconds).
"use strict";

(() => {
  const { el, fill } = VT;
  const NAME = decodeURIComponent(location.pathname.replace(/^\/studies\//, ""));
  const BASE = `/dashboard/studies/${encodeURIComponent(NAME)}`;
  const STATES = ["COMPLETE", "RUNNING", "WAITING", "PRUNED", "FAIL"];
  const IMPORTANCE_EVERY_MS = 15000;
  // Points per scatter plot (the server thins to this, keeping extremes and fronts exact).
  const POINTS = 2000;
  const EVALUATORS = { PedAnovaImportanceEvaluator: "PED-ANOVA", FanovaImportanceEvaluator: "fANOVA" };
  const LARGE_STUDY = 2000;
  const LARGE_REDRAW_MS = 10000;
  // The region map: a colour per memory outcome (or state, for trials that did not run to an
  // end); a pruned trial keeps its outcome's colour and is drawn as a triangle.
  const REGION_COLOR = {
    "as asked": "#19a979",
    resized: "#4f6bed",
    routed: "#945ecf",
    oom: "#d64545",
    infeasible: "#2d2d2d",
    "waiting for a larger card": "#d98a00",
    failed: "#ed4a7b",
    running: "#13a4b4",
    waiting: "#c9b037",
  };
  // Resized trials are grouped by the rungs they used ("resized: micro-batches + checkpointing"):
  // shades of blue, each combination its own, the same on every redraw.
  const RESIZED_COLORS = ["#4f6bed", "#2f8fd8", "#1f3fa0", "#7d9bff", "#0b6e99", "#5a4fcf"];

  function regionColor(name) {
    if (REGION_COLOR[name]) return REGION_COLOR[name];
    if (!name.startsWith("resized")) return "#777";
    let hash = 0;
    for (const ch of name) hash = (hash * 31 + ch.charCodeAt(0)) >>> 0;
    return RESIZED_COLORS[hash % RESIZED_COLORS.length];
  }
  const PRUNED_SYMBOL = "triangle";

  const table = { sort: "number", order: "desc", states: [], outcome: "", worker: "", offset: 0, limit: 50, total: 0 };
  let overview = null;
  let revision = null;
  let objective = 0; // the objective the history, memory plot and importances show
  let importancesBusy = 0;
  let importancesRevision = null; // the revision the drawn importances were asked for
  let selected = null;
  let selectedByUser = false;
  let importancesAt = 0;
  let plotsAt = 0;
  const sequence = {};

  /** Run ``load`` for ``key``; an answer that a newer call of the same key overtook is dropped. */
  async function latestOnly(key, load, render, card) {
    const ticket = (sequence[key] = (sequence[key] || 0) + 1);
    try {
      const data = await load();
      if (ticket === sequence[key]) render(data);
    } catch (error) {
      if (ticket === sequence[key] && card) showCardError(card, error);
      if (error.status === 401) return;
      throw error;
    }
  }

  function showCardError(card, error) {
    const node = document.querySelector(`#${card} .empty`);
    if (node) node.textContent = error.message;
  }

  function objectiveName(index) {
    return (overview && overview.objective_names[index]) || "value";
  }

  // ------------------------------------------------------------------ header

  function renderHeader(o) {
    document.title = `${o.name} · vramtune`;
    document.getElementById("study-name").textContent = o.name;
    fill(document.getElementById("study-state"), VT.badge(o.state));
    fill(
      document.getElementById("study-meta"),
      el("span", {}, "task ", el("b", { text: o.task || "plain Optuna study" })),
      el("span", {}, o.directions.map((d, i) => `${d} ${objectiveName(i)}`).join(", ")),
      o.card_models.length ? el("span", {}, "cards ", el("b", { text: o.card_models.join(", ") })) : null,
    );
    const c = o.counts;
    const best = o.best;
    fill(
      document.getElementById("study-summary"),
      tile("Finished", o.n_trials ? `${o.finished} / ${o.n_trials}` : o.finished, [`${c.COMPLETE - o.infeasible} complete`, o.infeasible ? `${o.infeasible} infeasible` : null, `${c.PRUNED} pruned`, `${c.FAIL} failed`].filter(Boolean).join(" · ")),
      tile("Running", o.running, `${c.WAITING} waiting`),
      tile("Trials per hour", VT.rate(o.trials_per_hour), "over the last hour"),
      best
        ? tile(`Best ${objectiveName(0)}`, VT.value(best.values[0]), `trial #${best.number}: ${paramText(best.params)}`)
        : tile(o.directions.length > 1 ? "Objectives" : "Best value", o.directions.length > 1 ? o.directions.length : "–", o.directions.length > 1 ? "see the Pareto front" : "no completed trial yet"),
    );
    renderActions(o);
  }

  function tile(label, value, sub) {
    return el("div", { class: "tile" }, el("div", { class: "label", text: label }), el("div", { class: "value", text: value }), el("div", { class: "sub", text: sub }));
  }

  function paramText(params) {
    return Object.entries(params).map(([k, v]) => `${k}=${VT.num(v)}`).join(", ");
  }

  function renderActions(o) {
    const box = document.getElementById("study-actions");
    if (!o.task) return fill(box);
    const path = `/studies/${encodeURIComponent(o.name)}`;
    const act = async (method, suffix, confirmText) => {
      if (confirmText && !window.confirm(confirmText)) return;
      try {
        await VT.api(path + suffix, { method });
        if (method === "DELETE") location.assign("/");
      } catch (error) {
        window.alert(error.message);
      }
      refresh.now();
    };
    fill(
      box,
      VT.can("submit") && o.state === "running" ? el("button", { type: "button", "data-action": "pause", onclick: () => act("POST", "/pause"), text: "Pause" }) : null,
      VT.can("submit") && o.state === "paused" ? el("button", { type: "button", "data-action": "resume", onclick: () => act("POST", "/resume"), text: "Resume" }) : null,
      VT.can("admin") ? el("button", { type: "button", class: "danger", "data-action": "delete", onclick: () => act("DELETE", "", `Delete study "${o.name}" and all its trials?`), text: "Delete" }) : null,
    );
  }

  // ------------------------------------------------------------------ plots

  function hint(id, text) {
    document.getElementById(id).textContent = text;
  }

  function thinned(data, shown) {
    return data.downsampled ? ` · ${shown.toLocaleString()} drawn` : "";
  }

  const pick = (number) => selectTrial(number, true);

  const objectiveQuery = () => `objective=${objective}&max_points=${POINTS}`;
  const shown = {}; // the objective each plot last drew: another one resets its zoom

  function sameObjective(plot, index) {
    const same = shown[plot] === index;
    shown[plot] = index;
    return same;
  }

  async function loadHistory(early) {
    await latestOnly("history", () => early || VT.api(`${BASE}/history?${objectiveQuery()}`), (d) => {
      VT.plot(
        document.getElementById("plot-history"),
        {
          x: { title: "trial", integer: true },
          y: { title: objectiveName(d.objective) },
          keepView: sameObjective("history", d.objective),
          onClick: pick,
          traces: [
            { name: "trial", mode: "markers", x: d.numbers, y: d.values, data: d.numbers, color: VT.COLORS[0], size: 5, opacity: 0.6, hover: (i) => `trial #${d.numbers[i]}\n${VT.num(d.values[i])}` },
            { name: "best so far", mode: "lines", shape: "hv", x: d.best_numbers, y: d.best_values, color: VT.COLORS[1], width: 2.5 },
          ],
        },
        "No completed trial yet.",
      );
      hint("history-hint", `${d.direction} ${objectiveName(d.objective)} · ${d.total.toLocaleString()} completed${thinned(d, d.numbers.length)}`);
    }, "card-history");
  }

  async function loadMemory(early) {
    await latestOnly("memory", () => early || VT.api(`${BASE}/memory?${objectiveQuery()}`), (d) => {
      const scale = VT.byteScale(d.measured_bytes);
      const byCard = new Map();
      d.numbers.forEach((n, i) => {
        const card = d.card_models[i] || "unknown card";
        if (!byCard.has(card)) byCard.set(card, { x: [], y: [], n: [] });
        const group = byCard.get(card);
        group.x.push(d.measured_bytes[i] / scale.div);
        group.y.push(d.values[i]);
        group.n.push(n);
      });
      const point = (g, prefix = "") => (i) => `${prefix}trial #${g.n[i]}\n${VT.num(g.x[i])} ${scale.name}\n${VT.num(g.y[i])}`;
      const traces = [...byCard.entries()].map(([card, g], i) => ({
        name: card, mode: "markers", x: g.x, y: g.y, data: g.n, color: VT.COLORS[(i + 2) % VT.COLORS.length], size: 6, opacity: 0.6, hover: point(g),
      }));
      const front = { x: d.front_bytes.map((b) => b / scale.div), y: d.front_values, n: d.front_numbers };
      traces.push({ name: "Pareto front", mode: "lines+markers", shape: "hv", symbol: "diamond", x: front.x, y: front.y, data: front.n, color: VT.COLORS[1], size: 7, opacity: 1, hover: point(front, "front: ") });
      const type = VT.spanType(d.measured_bytes);
      document.getElementById("memory-title").textContent = `${objectiveName(d.objective)} vs peak memory`;
      VT.plot(
        document.getElementById("plot-memory"),
        { x: { title: VT.axisTitle("measured peak", scale.name, type), type }, y: { title: objectiveName(d.objective) }, keepView: sameObjective("memory", d.objective), onClick: pick, traces },
        "No completed trial with a measured peak yet.",
      );
      hint("memory-hint", `${d.total.toLocaleString()} trials · ${d.front_numbers.length} on the front${thinned(d, d.numbers.length)}`);
    }, "card-memory");
  }

  /** The objective selectors, filled once the overview names the objectives. */
  function setupObjectiveSelectors(o) {
    const multi = o.directions.length > 1;
    document.getElementById("objective-bar").classList.toggle("hidden", !multi);
    document.getElementById("card-pareto").classList.toggle("hidden", !multi);
    if (!multi) return;
    const options = () => o.directions.map((d, i) => el("option", { value: i, text: `${objectiveName(i)} (${d})` }));
    const ids = { objective: objective, "pareto-x": 0, "pareto-y": 1 };
    for (const [id, fallback] of Object.entries(ids)) {
      const select = document.getElementById(id);
      const keep = select.options.length ? Number(select.value) : fallback;
      fill(select, options());
      select.value = String(keep < o.directions.length ? keep : fallback);
    }
  }

  function chooseObjective(index) {
    objective = index;
    return Promise.all([loadHistory(), loadMemory(), loadImportances()]);
  }

  async function loadPareto() {
    if (!overview || overview.directions.length < 2) return;
    const x = Number(document.getElementById("pareto-x").value);
    const y = Number(document.getElementById("pareto-y").value);
    if (x === y) {
      VT.plot(document.getElementById("plot-pareto"), { x: {}, y: {}, traces: [] }, "Choose two different objectives.");
      hint("pareto-hint", "");
      return;
    }
    await latestOnly("pareto", () => VT.api(`${BASE}/pareto?x=${x}&y=${y}&max_points=${POINTS}`), (d) => {
      const onFront = new Set(d.front_numbers);
      const rest = d.numbers.map((n, i) => i).filter((i) => !onFront.has(d.numbers[i]));
      const xName = objectiveName(d.x_objective);
      const yName = objectiveName(d.y_objective);
      const text = (n, a, b, prefix = "") => `${prefix}trial #${n}\n${xName} ${VT.num(a)}\n${yName} ${VT.num(b)}`;
      const pair = `${d.x_objective}/${d.y_objective}`;
      VT.plot(
        document.getElementById("plot-pareto"),
        {
          x: { title: `${xName} (${d.x_direction})` },
          y: { title: `${yName} (${d.y_direction})` },
          keepView: sameObjective("pareto", pair),
          onClick: pick,
          traces: [
            { name: "trial", mode: "markers", x: rest.map((i) => d.x[i]), y: rest.map((i) => d.y[i]), data: rest.map((i) => d.numbers[i]), color: VT.COLORS[0], size: 6, opacity: 0.55, hover: (k) => text(d.numbers[rest[k]], d.x[rest[k]], d.y[rest[k]]) },
            // The front's staircase bounds what it dominates: along x first when x is minimized.
            { name: "Pareto front", mode: "lines+markers", shape: d.x_direction === "minimize" ? "hv" : "vh", symbol: "diamond", x: d.front_x, y: d.front_y, data: d.front_numbers, color: VT.COLORS[1], size: 8, opacity: 1, hover: (k) => text(d.front_numbers[k], d.front_x[k], d.front_y[k], "front: ") },
          ],
        },
        "No completed trial with both values yet.",
      );
      hint("pareto-hint", `${d.total.toLocaleString()} trials · ${d.front_numbers.length} on the front${thinned(d, d.numbers.length)}`);
    }, "card-pareto");
  }

  async function loadCalibration(early) {
    await latestOnly("calibration", () => early || VT.api(`${BASE}/calibration?max_points=${POINTS}`), (d) => {
      const all = d.cards.flatMap((c) => [...c.predicted_bytes, ...c.measured_bytes]);
      const scale = VT.byteScale(all);
      const top = Math.max(0, ...all) / scale.div;
      const type = VT.spanType(all); // one type for both axes: the diagonal stays a diagonal
      const low = type === "log" ? Math.min(...all.filter((b) => b > 0)) / scale.div / 1.05 : 0;
      const traces = d.cards.map((c, i) => {
        const x = c.predicted_bytes.map((b) => b / scale.div);
        const y = c.measured_bytes.map((b) => b / scale.div);
        return {
          name: c.card_model, mode: "markers", x, y, data: c.numbers, color: VT.COLORS[(i + 2) % VT.COLORS.length], size: 6, opacity: 0.65,
          hover: (k) => `trial #${c.numbers[k]} (${c.outcomes[k]})\npredicted ${VT.num(x[k])} ${scale.name}\nmeasured ${VT.num(y[k])} ${scale.name}`,
        };
      });
      if (traces.length) traces.push({ name: "measured = predicted", mode: "lines", dash: true, width: 1, x: [low, top * 1.05], y: [low, top * 1.05], color: "#9aa3b5" });
      const axis = (name) => ({ title: VT.axisTitle(name, scale.name, type), type, zero: type !== "log" });
      VT.plot(
        document.getElementById("plot-calibration"),
        { x: axis("predicted peak"), y: axis("measured peak"), keepView: true, onClick: pick, traces },
        "No run with a prediction yet.",
      );
      const pct = (v) => (v === null ? "–" : `${(v * 100).toFixed(1)} %`);
      const signed = (v) => (v === null ? "–" : `${v > 0 ? "+" : ""}${(v * 100).toFixed(1)} %`);
      const columns = [
        ["card", "", (c) => c.card_model],
        ["samples", "runs with a prediction", (c) => c.n.toLocaleString()],
        ["median bias", "measured / predicted − 1: above 0, runs used more than predicted", (c) => signed(c.median_bias)],
        ["median |error|", "", (c) => pct(c.median_abs_error)],
        ["p95 |error|", "", (c) => pct(c.p95_abs_error)],
        ["under-predicted", "runs that used more than predicted", (c) => pct(c.under_fraction)],
      ];
      fill(
        document.getElementById("calibration-stats"),
        d.cards.length ? el("thead", {}, el("tr", {}, columns.map(([name, title], i) => el("th", { class: i ? "num" : "", title, text: name })))) : null,
        el("tbody", {}, d.cards.map((c) => el("tr", {}, columns.map(([name, , cell], i) => el("td", { class: i ? "num" : "", "data-col": name, text: cell(c) }))))),
      );
      document.getElementById("calibration-note").textContent = d.cards.length
        ? "Under-predicted: runs that used more memory than the trace predicted, before any calibration. " +
          "Workers are served a fit of these runs per card model: predictions are scaled, offset and given a margin " +
          `so that about ${pct(d.target_under_fraction)} of runs exceed them. Runs beyond the margin can run out of memory.`
        : "";
    }, "card-calibration");
  }

  function paramInfo(name) {
    return (overview.params || []).find((p) => p.name === name);
  }

  // Trials share the few values of a categorical parameter: spread them around each value
  // (by a fixed function of the trial number, so a redraw does not move them).
  function jitter(number, salt) {
    return ((((number + 1) * (salt ? 0.7548776662 : 0.5698402910)) % 1) - 0.5) * 0.6;
  }

  function text(value) {
    return value === null ? "null" : String(value);
  }

  function regionAxis(name, salt) {
    const info = paramInfo(name);
    if (info && info.kind === "categorical") {
      const ticks = info.choices.map((c, i) => [i, text(c)]);
      const position = (v, n) => info.choices.findIndex((c) => c === v) + jitter(n, salt);
      return { axis: { title: name, ticks, range: [-0.5, ticks.length - 0.5], grid: false }, place: (values, numbers) => values.map((v, i) => position(v, numbers[i])) };
    }
    return { axis: { title: name, type: info && info.log ? "log" : "linear" }, place: (values) => values };
  }

  function setupRegionSelectors(params) {
    const names = params.map((p) => p.name);
    for (const select of [document.getElementById("region-x"), document.getElementById("region-y")]) {
      const known = [...select.options].map((o) => o.value);
      if (known.join("\u0000") === names.join("\u0000")) continue;
      const keep = select.value;
      fill(select, names.map((n) => el("option", { value: n, text: n })));
      select.value = names.includes(keep) ? keep : "";
    }
  }

  let regionPair = "";

  /** The region map; without chosen parameters the server picks the memory-related ones. */
  async function loadRegions(early) {
    const x = document.getElementById("region-x").value;
    const y = document.getElementById("region-y").value;
    const node = document.getElementById("plot-regions");
    const query = new URLSearchParams({ max_points: POINTS });
    if (x && y) {
      query.set("x", x);
      query.set("y", y);
    }
    await latestOnly("regions", () => early || VT.api(`${BASE}/regions?${query}`), (d) => {
      if (!d.x) return VT.plot(node, { x: {}, y: {}, traces: [] }, "The study has no parameters yet.");
      document.getElementById("region-x").value = d.x;
      document.getElementById("region-y").value = d.y;
      const ax = regionAxis(d.x, 0);
      const ay = regionAxis(d.y, 1);
      const part = (c, indices, pruned) => {
        const numbers = indices.map((i) => c.numbers[i]);
        return {
          name: pruned ? "" : `${c.name} (${c.count})`, mode: "markers", data: numbers,
          x: ax.place(indices.map((i) => c.x[i]), numbers), y: ay.place(indices.map((i) => c.y[i]), numbers),
          color: regionColor(c.name), symbol: pruned ? PRUNED_SYMBOL : "circle", size: pruned ? 8 : 7, opacity: 0.75,
          hover: (k) => `trial #${numbers[k]}: ${c.name}${pruned ? ", pruned" : ""}\n${d.x} = ${text(c.x[indices[k]])}\n${d.y} = ${text(c.y[indices[k]])}`,
        };
      };
      const traces = [];
      for (const c of d.categories) {
        const all = c.numbers.map((_, i) => i);
        traces.push(part(c, all.filter((i) => !c.pruned[i]), false)); // named: the legend's entry
        const pruned = all.filter((i) => c.pruned[i]);
        if (pruned.length) traces.push(part(c, pruned, true));
      }
      if (d.categories.some((c) => c.pruned.includes(true))) {
        traces.push({ name: "pruned", mode: "markers", x: [], y: [], color: "#8a93a6", symbol: PRUNED_SYMBOL });
      }
      const pair = `${d.x}\u0000${d.y}`;
      VT.plot(node, { x: ax.axis, y: ay.axis, keepView: pair === regionPair, onClick: pick, traces }, "No trial holds both parameters yet.");
      regionPair = pair;
      hint("regions-hint", `${d.total.toLocaleString()} trials`);
    }, "card-regions");
  }

  /** The importances, after the rest of the page: their first computation can take seconds. */
  async function loadImportances() {
    importancesAt = Date.now();
    const asked = revision;
    const node = document.getElementById("plot-importances");
    if (Number(node.dataset.points || 0) === 0 || shown.importances !== objective) {
      VT.plot(node, { x: {}, y: {}, traces: [] }, "Computing importances…");
      hint("importances-hint", "");
    }
    importancesBusy += 1;
    try {
      await latestOnly("importances", () => VT.api(`${BASE}/importances?objective=${objective}`), (d) => {
        importancesRevision = asked;
        renderImportances(d);
      }, "card-importances");
    } finally {
      importancesBusy -= 1;
    }
  }

  /** Ask for importances again when the study changed (a running one: every 15 s at most). */
  function refreshImportances() {
    if (importancesBusy || importancesRevision === revision) return;
    if (importancesAt && Date.now() - importancesAt < IMPORTANCE_EVERY_MS) return;
    // Not awaited: a slow first computation must not hold the live updates back.
    loadImportances().catch((error) => console.warn("vramtune: importances failed:", error.message));
  }

  function renderImportances(d) {
    shown.importances = d.objective;
    const sorted = [...d.importances].sort((a, b) => a.importance - b.importance);
    const longest = Math.max(0, ...sorted.map((i) => i.name.length));
    const top = Math.max(0.01, ...sorted.map((i) => i.importance));
    VT.plot(
      document.getElementById("plot-importances"),
      {
        x: { title: "importance", range: [0, top * 1.08] },
        y: { ticks: [], range: [-0.6, sorted.length - 0.4], grid: false },
        legend: false,
        marginLeft: Math.min(220, 24 + 7 * longest),
        traces: [{ mode: "bars", x: sorted.map((i) => i.importance), y: sorted.map((_, k) => k), labels: sorted.map((i) => i.name), color: VT.COLORS[0], hover: (k) => `${sorted[k].name}: ${sorted[k].importance.toFixed(3)}` }],
      },
      d.note || "No importances yet.",
    );
    document.getElementById("importances-caveat").textContent = d.caveat ? `Caveat: ${d.caveat}.` : "";
    const which = overview && overview.directions.length > 1 ? `${objectiveName(d.objective)} · ` : "";
    hint("importances-hint", d.n_used ? `${which}Optuna ${EVALUATORS[d.evaluator] || d.evaluator} on ${d.n_used.toLocaleString()} of ${d.n_complete.toLocaleString()} completed` : "");
    document.body.dataset.importances = `${revision}/${d.objective}`;
  }

  function selectTrial(number, byUser) {
    selected = number;
    selectedByUser = selectedByUser || byUser;
    for (const row of document.querySelectorAll("#trials tbody tr")) row.classList.toggle("selected", Number(row.dataset.number) === number);
    return loadCurve();
  }

  async function loadCurve() {
    const node = document.getElementById("plot-curve");
    if (selected === null) {
      VT.plot(node, { x: {}, y: {}, traces: [] }, "Click a trial in a plot or in the table.");
      return;
    }
    await latestOnly("curve", () => VT.api(`${BASE}/trials/${selected}`), (t) => {
      document.getElementById("curve-title").textContent = `Trial #${t.number}`;
      VT.plot(
        node,
        {
          x: { title: "step", integer: true },
          y: { title: "reported value" },
          legend: false,
          traces: [{ mode: "lines+markers", x: t.intermediate_steps, y: t.intermediate_values, color: VT.COLORS[0], size: 5, opacity: 1, hover: (i) => `step ${t.intermediate_steps[i]}: ${VT.value(t.intermediate_values[i])}` }],
        },
        "This trial reported no intermediate value.",
      );
      hint("curve-hint", `${t.state.toLowerCase()}${t.intermediate_total ? ` · ${t.intermediate_total} reports` : ""}`);
      const pairs = [
        ["value", t.feasible ? (t.values || []).map(VT.value).join(", ") || "–" : "– (infeasible)"],
        ["params", paramText(t.params)],
        ["plan", planText(t)],
        ["peak predicted / measured", `${VT.bytes(t.predicted_bytes)} / ${VT.bytes(t.measured_bytes)}`],
        ["plan chosen in", planningText(t)],
        ["worker", t.worker ? `${t.worker} (${t.card_model})` : "–"],
        ["duration", VT.duration(t.duration_s)],
        ["step time predicted / measured", stepTimeText((t.user_attrs || {})["vramtune.step_time"])],
        ["attempts", String(t.attempt + 1)],
      ];
      if (t.rank_peak_bytes && t.rank_peak_bytes.length > 1) pairs.splice(4, 0, ["per rank predicted / measured", rankText(t)]);
      if (t.message) pairs.push(["message", t.message]);
      fill(document.getElementById("curve-details"), pairs.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
      renderTimeline(t.events || []);
    }, "card-curve");
  }

  /** The trial's story, oldest first: what each call did to it (vramtune/service/fleet/events.py). */
  function renderTimeline(events) {
    const time = (at) => new Date(at).toLocaleTimeString();
    fill(
      document.getElementById("trial-timeline"),
      events.map((e) => el("li", { "data-event": e.kind }, el("time", { datetime: e.at, text: time(e.at) }), e.text)),
    );
  }

  // ------------------------------------------------------------------ advice

  /** What to do next: each advice with its changes (vramtune/service/dashboard/advice.py). */
  async function loadAdvice() {
    await latestOnly("advice", () => VT.api(`${BASE}/advice`), (d) => {
      document.getElementById("card-advice").classList.toggle("hidden", !d.items.length);
      const items = d.items.map((a) =>
        el(
          "li",
          { "data-advice": a.kind },
          el("h3", { text: a.title }),
          el("p", { text: a.text }),
          el("ul", {}, a.actions.map((action) => el("li", { text: action }))),
        ),
      );
      fill(document.getElementById("advice-list"), items);
      document.body.dataset.advice = revision;
    }, null);
  }

  // ------------------------------------------------------------------ trial table

  // How long the worker took to choose the plan, and whether it traced or took the fleet's
  // predictions (shared across workers, so a shape is traced once).
  function planningText(t) {
    if (t.planning_s === null || t.planning_s === undefined) return "–";
    const source = { fleet: "the fleet's predictions", worker: "its own traces", mixed: "the fleet's and its own" }[t.prediction_source];
    return source ? `${VT.duration(t.planning_s)}, from ${source}` : VT.duration(t.planning_s);
  }

  // The fleet's step-time model (vramtune/service/step_time.py): seconds per optimizer step.
  function stepTimeText(step) {
    if (!step) return "–";
    const seconds = (s) => (s === null || s === undefined ? "–" : `${VT.num(s * 1000)} ms`);
    return `${seconds(step.predicted_step_s)} / ${seconds(step.measured_step_s)}`;
  }

  // A distributed run's peaks: every rank was predicted alike (rank 0 is traced), each measured.
  function rankText(t) {
    const predicted = VT.bytes(t.predicted_bytes);
    return t.rank_peak_bytes.map((peak, rank) => `rank ${rank}: ${predicted} / ${VT.bytes(peak)}`).join(" · ");
  }

  // The plan's rungs in words, as the server says them (vramtune.common.plans.plan_in_words).
  function planText(row) {
    return row.plan_words || "–";
  }

  function columns() {
    const o = overview;
    const cols = [
      { label: "#", sort: "number", num: true, cell: (r) => r.number },
      { label: "State", sort: "state", cell: (r) => VT.badge(r.state) },
    ];
    const value = (r, i) => (r.feasible ? VT.value(r.values ? r.values[i] : null) : el("span", { class: "muted", title: "infeasible: the value is a placeholder", text: "–" }));
    o.directions.forEach((_, i) => cols.push({ label: objectiveName(i), sort: i === 0 ? "value" : `value:${i}`, num: true, cell: (r) => value(r, i) }));
    for (const p of o.params) {
      cols.push({ label: p.name, sort: `param:${p.name}`, num: p.kind !== "categorical", cell: (r) => (p.name in r.params ? VT.num(r.params[p.name]) : "–") });
    }
    cols.push(
      { label: "Outcome", sort: "outcome", cell: outcomeCell },
      { label: "Plan", cell: (r) => el("span", { class: "plan", title: r.plan ? r.plan.reason : "", text: planText(r) }) },
      { label: "Predicted", sort: "predicted", num: true, cell: (r) => VT.bytes(r.predicted_bytes) },
      { label: "Measured", sort: "measured", num: true, cell: (r) => VT.bytes(r.measured_bytes) },
      { label: "Worker", sort: "worker", cell: (r) => r.worker || "–" },
      { label: "Duration", sort: "duration", num: true, cell: (r) => VT.duration(r.duration_s) },
    );
    return cols;
  }

  function renderTableHead(cols) {
    const head = el(
      "tr",
      {},
      cols.map((c) => {
        const sorted = c.sort && c.sort === table.sort ? `sorted-${table.order}` : "";
        return el("th", {
          class: [c.num ? "num" : "", c.sort ? "sortable" : "", sorted].join(" ").trim(),
          "data-sort": c.sort || null,
          text: c.label,
          onclick: c.sort
            ? () => {
                table.order = table.sort === c.sort && table.order === "desc" ? "asc" : table.sort === c.sort ? "desc" : c.sort === "number" ? "desc" : "asc";
                table.sort = c.sort;
                table.offset = 0;
                loadTable();
              }
            : null,
        });
      }),
    );
    fill(document.querySelector("#trials thead"), head);
  }

  /** vramtune's outcome names as words ("as_asked": "as asked"), as the region map names them. */
  const outcomeText = (outcome) => outcome.replace(/_/g, " ");

  /** The most informative outcome ("routed, pruned"); a waiting trial says why it waits, a
   *  trial its worker is planning for how long (a long plan looks like a hung trial). */
  function outcomeCell(r) {
    if (r.note) return el("span", { class: "waiting-note", text: r.note });
    if (r.planning_since) {
      const seconds = Math.max(0, Math.round((Date.now() - Date.parse(r.planning_since)) / 1000));
      return el("span", { class: "planning-note", text: `planning ${seconds} s` });
    }
    const told = r.told_outcome || r.outcome;
    return told ? outcomeText(told) : "–";
  }

  function syncOptions(select, values, extra, label = (v) => v) {
    const wanted = ["", ...values, ...extra];
    const have = [...select.options].map((o) => o.value);
    if (have.join("\u0000") === wanted.join("\u0000")) return;
    const keep = select.value;
    fill(select, wanted.map((v) => el("option", { value: v, text: v ? label(v) : "all" })));
    select.value = wanted.includes(keep) ? keep : "";
  }

  function tableUrl() {
    const query = new URLSearchParams({ sort: table.sort, order: table.order, offset: table.offset, limit: table.limit });
    for (const s of table.states) query.append("state", s);
    if (table.outcome) query.append("outcome", table.outcome);
    if (table.worker) query.set("worker", table.worker);
    return `${BASE}/trials?${query}`;
  }

  async function loadTable(early) {
    await latestOnly("table", () => early || VT.api(tableUrl()), (d) => {
      const cols = columns();
      renderTableHead(cols);
      const rows = d.rows.map((r) =>
        el(
          "tr",
          { class: `clickable${r.number === selected ? " selected" : ""}`, "data-number": r.number, onclick: () => selectTrial(r.number, true) },
          cols.map((c) => el("td", { class: c.num ? "num" : "", "data-col": c.sort || c.label.toLowerCase() }, c.cell(r))),
        ),
      );
      fill(document.querySelector("#trials tbody"), rows.length ? rows : el("tr", {}, el("td", { colspan: cols.length, class: "muted", text: "No trial matches the filters." })));
      document.getElementById("trials-note").textContent = d.note ? `Trials wait: ${d.note}.` : "";
      syncOptions(document.getElementById("outcome-filter"), d.outcomes, ["none"], outcomeText);
      syncOptions(document.getElementById("worker-filter"), d.workers, []);
      const last = Math.min(d.offset + d.rows.length, d.total);
      table.total = d.total;
      document.getElementById("page-info").textContent = d.total ? `${(d.offset + 1).toLocaleString()}–${last.toLocaleString()} of ${d.total.toLocaleString()}` : "0 trials";
      for (const id of ["first-page", "prev-page"]) document.getElementById(id).disabled = d.offset === 0;
      for (const id of ["next-page", "last-page"]) document.getElementById(id).disabled = last >= d.total;
    }, null);
  }

  function setupTableControls() {
    fill(
      document.getElementById("state-filter"),
      STATES.map((s) =>
        el("label", {}, el("input", { type: "checkbox", value: s, onchange: (e) => {
          table.states = e.target.checked ? [...table.states, s] : table.states.filter((x) => x !== s);
          table.offset = 0;
          loadTable();
        } }), s.toLowerCase()),
      ),
    );
    const onSelect = (id, key) => document.getElementById(id).addEventListener("change", (e) => {
      table[key] = key === "limit" ? Number(e.target.value) : e.target.value;
      table.offset = 0;
      loadTable();
    });
    onSelect("outcome-filter", "outcome");
    onSelect("worker-filter", "worker");
    onSelect("page-size", "limit");
    const pages = {
      "first-page": () => 0,
      "prev-page": () => Math.max(0, table.offset - table.limit),
      "next-page": () => table.offset + table.limit,
      "last-page": () => Math.max(0, Math.floor((table.total - 1) / table.limit) * table.limit),
    };
    for (const [id, offset] of Object.entries(pages)) {
      document.getElementById(id).addEventListener("click", () => {
        table.offset = offset();
        loadTable();
      });
    }
    for (const id of ["region-x", "region-y"]) document.getElementById(id).addEventListener("change", () => loadRegions());
    for (const id of ["pareto-x", "pareto-y"]) document.getElementById(id).addEventListener("change", () => loadPareto());
    document.getElementById("objective").addEventListener("change", (e) => chooseObjective(Number(e.target.value)));
  }

  // ------------------------------------------------------------------ live

  let missing = false;

  function showMissing() {
    missing = true;
    fill(
      document.querySelector("main"),
      el("section", { class: "card" }, el("h1", { text: NAME }), el("p", { class: "muted", text: "There is no study of this name (it may have been deleted)." }), el("a", { href: "/", text: "All studies" })),
    );
  }

  /** The first load asks for every plot at once: none waits for the header's answer. */
  function earlyRequests() {
    const early = {
      history: VT.api(`${BASE}/history?${objectiveQuery()}`),
      memory: VT.api(`${BASE}/memory?${objectiveQuery()}`),
      calibration: VT.api(`${BASE}/calibration?max_points=${POINTS}`),
      regions: VT.api(`${BASE}/regions?max_points=${POINTS}`),
      table: VT.api(tableUrl()),
    };
    for (const request of Object.values(early)) request.catch(() => {}); // awaited later
    return early;
  }

  async function tick() {
    if (missing) return;
    const early = revision === null && !overview ? earlyRequests() : {};
    try {
      overview = await VT.api(BASE);
    } catch (error) {
      if (error.status === 404) return showMissing();
      throw error;
    }
    renderHeader(overview);
    if (overview.revision === revision) {
      await loadAdvice(); // the fleet changes without the study: a worker may come or go
      return refreshImportances();
    }
    // A large running study changes on every poll: its plots are redrawn every 10 s at most.
    const large = overview.finished + overview.running > LARGE_STUDY;
    if (revision !== null && large && Date.now() - plotsAt < LARGE_REDRAW_MS) {
      await loadTable();
      return; // revision stays old: a later poll redraws the plots
    }
    revision = overview.revision;
    plotsAt = Date.now();
    setupRegionSelectors(overview.params);
    setupObjectiveSelectors(overview);
    if (!selectedByUser && overview.best) selected = overview.best.number;
    const jobs = [loadHistory(early.history), loadMemory(early.memory), loadCalibration(early.calibration)];
    jobs.push(loadRegions(early.regions), loadTable(early.table), loadCurve(), loadPareto(), loadAdvice());
    const results = await Promise.allSettled(jobs);
    const failed = results.find((r) => r.status === "rejected");
    if (failed) throw failed.reason;
    document.body.dataset.rendered = revision;
    refreshImportances();
  }

  let refresh = null;

  async function main() {
    const scopes = VT.start("studies"); // in parallel with the data: only buttons wait for it
    setupTableControls();
    refresh = VT.poll(tick, 3000);
    await scopes;
    if (overview) renderActions(overview);
    VT.onAuthChange(() => {
      revision = null;
      importancesAt = 0;
      refresh.now();
    });
  }

  main().catch((error) => VT.errorBox(document.querySelector("main"), error));
})();

// The fleet page: workers, their cards and memory, what they run, who went quiet.
"use strict";

(() => {
  const { el, fill } = VT;
  // Live workers come first; a page of PAGE at a time keeps a large fleet's page light.
  const PAGE = 100;
  const page = { offset: 0, total: 0 };

  function tile(label, value, sub) {
    return el("div", { class: "tile" }, el("div", { class: "label", text: label }), el("div", { class: "value", text: value }), sub ? el("div", { class: "sub", text: sub }) : null);
  }

  function memory(worker) {
    const share = worker.total_bytes ? worker.free_bytes / worker.total_bytes : 0;
    const bar = el("span", { class: "membar", title: `${(share * 100).toFixed(0)} % free` }, el("span", {}));
    bar.firstChild.style.width = `${(share * 100).toFixed(1)}%`;
    return el("span", {}, bar, `${VT.bytes(worker.free_bytes)} / ${VT.bytes(worker.total_bytes)}`);
  }

  // A node worker's cards (one per rank of a distributed trial): a square each, filled while a
  // trial runs on it, then how many are busy. A one-card worker shows "1".
  function cards(worker) {
    if (worker.cards <= 1) return el("span", { text: "1" });
    const busy = Math.min(worker.busy_cards, worker.cards);
    const squares = Array.from({ length: worker.cards }, (_, i) => el("span", { class: i < busy ? "cardsq busy" : "cardsq" }));
    return el("span", { title: `${busy} of ${worker.cards} cards busy, ${VT.bytes(worker.total_bytes)} each` }, el("span", { class: "cardsqs" }, squares), `${busy} of ${worker.cards} busy`);
  }

  function current(worker) {
    if (!worker.current.length) return el("span", { class: "muted", text: "idle" });
    // A packing worker (--max-trials-per-card) holds several leases: say how many run at once.
    const together = worker.current.length > 1 ? el("span", { class: "muted", "data-col": "at-once", text: `${worker.current.length} at once: ` }) : null;
    return el(
      "div",
      { class: "chips" },
      together,
      worker.current.map((t) =>
        t.study
          ? el("a", { class: "chip", href: `/studies/${encodeURIComponent(t.study)}`, title: `trial id ${t.trial_id}, attempt ${t.attempt}` }, `${t.study} #${t.number}`, t.world_size > 1 ? ` · ${t.world_size} cards` : "")
          : el("span", { class: "chip", text: `trial id ${t.trial_id}` }),
      ),
    );
  }

  function render(data) {
    const t = data.totals;
    const models = Object.entries(t.card_models).map(([m, n]) => `${n}× ${m}`).join(", ");
    fill(
      document.getElementById("fleet-summary"),
      tile("Live workers", t.workers.live, models || "none live"),
      tile("Stale / lost", `${t.workers.stale} / ${t.workers.lost}`, `${t.workers.stopped} stopped`),
      tile("Free memory (live)", VT.bytes(t.free_bytes), `of ${VT.bytes(t.total_bytes)}`),
      tile("Trials running", t.running_trials),
    );
    const rows = data.workers.map((w) =>
      el(
        "tr",
        { "data-worker": w.name, "data-state": w.state, class: w.state === "stopped" ? "stopped" : "" },
        el("td", { class: "name", text: w.name }),
        el("td", {}, VT.badge(w.state)),
        el("td", { text: w.device }),
        el("td", {}, w.card_model, w.simulated ? el("span", { class: "muted", text: " (simulated)" }) : null),
        el("td", { class: "nowrap", "data-col": "cards" }, cards(w)),
        el("td", { class: "nowrap" }, memory(w)),
        el("td", {}, current(w)),
        el("td", { class: w.state === "live" ? "" : "muted", text: VT.ago(w.last_heartbeat, data.now) }),
        el("td", { class: "num", "data-col": "trials", title: "trials run (not handed back) / completed", text: `${w.trials_run.toLocaleString()} / ${w.trials_done.toLocaleString()}` }),
        el("td", { class: "muted", text: w.tasks.join(", ") }),
      ),
    );
    fill(document.querySelector("#workers tbody"), rows);
    pager(data);
    document.getElementById("workers-empty").textContent = data.workers.length
      ? ""
      : "No workers yet: start one with `vramtune worker --server URL`.";
    document.getElementById("fleet-legend").textContent =
      `stale: no heartbeat for ${VT.duration(data.stale_after_s)}; lost: none for ${VT.duration(data.lost_after_s)}, its trials go back to the queue.`;
  }

  function pager(data) {
    page.total = data.total;
    const last = Math.min(data.offset + data.workers.length, data.total);
    document.getElementById("page-info").textContent = data.total
      ? `workers ${(data.offset + 1).toLocaleString()}–${last.toLocaleString()} of ${data.total.toLocaleString()}`
      : "";
    document.getElementById("prev-page").disabled = data.offset === 0;
    document.getElementById("next-page").disabled = last >= data.total;
  }

  async function load() {
    const data = await VT.api(`/dashboard/fleet?offset=${page.offset}&limit=${PAGE}`);
    if (data.offset > 0 && data.offset >= data.total) {
      page.offset = Math.max(0, Math.floor((data.total - 1) / PAGE) * PAGE); // the fleet shrank under this page
      return load();
    }
    render(data);
  }

  async function main() {
    VT.start("fleet"); // the scopes only matter to write buttons, which this page has none of
    const refresh = VT.poll(load, 3000);
    const turns = { "prev-page": () => Math.max(0, page.offset - PAGE), "next-page": () => page.offset + PAGE };
    for (const [id, offset] of Object.entries(turns)) {
      document.getElementById(id).addEventListener("click", () => {
        page.offset = offset();
        refresh.now();
      });
    }
    VT.onAuthChange(() => refresh.now());
  }

  main().catch((error) => VT.errorBox(document.querySelector("main"), error));
})();

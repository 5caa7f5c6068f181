// The studies page: every study, its progress and live counts.
"use strict";

(() => {
  const { el, fill } = VT;
  const STATE_ORDER = ["COMPLETE", "RUNNING", "WAITING", "PRUNED", "FAIL"];
  const MEMORY_ORDER = [["resized", "resized"], ["routed", "routed"], ["infeasible", "infeasible"], ["oom", "OOM"]];
  const MEMORY_TITLES = {
    resized: "completed resized: micro-batches, checkpointing, chunked cross-entropy or bf16",
    routed: "ran on a larger card after a hand-back (completed or pruned there)",
    infeasible: "fit no card of the fleet",
    oom: "ran out of memory at least once",
  };
  let latest = null;

  function studyLink(name) {
    return el("a", { href: `/studies/${encodeURIComponent(name)}`, text: name });
  }

  function progress(study) {
    if (!study.n_trials) return el("span", { class: "muted", text: `${study.finished} finished` });
    const share = Math.min(1, study.finished / study.n_trials);
    const bar = el("span", { class: "progress" }, el("span", {}));
    bar.firstChild.style.width = `${(share * 100).toFixed(1)}%`;
    return el("span", {}, bar, el("span", { class: "progress-label", text: `${study.finished} / ${study.n_trials}` }));
  }

  function counts(study) {
    return el(
      "div",
      { class: "chips" },
      STATE_ORDER.filter((s) => study.counts[s]).map((s) =>
        el("span", { class: `chip chip-${s}`, title: s }, el("b", { text: study.counts[s] }), ` ${s.toLowerCase()}`),
      ),
    );
  }

  /** What memory did to the study's trials: resized, routed, infeasible, OOM (nonzero ones). */
  /** A chip's words: routed ones pruned there say so ("routed (1 pruned)", vramtune.common.plans.told_outcome). */
  function memoryLabel(counts, key, label) {
    return key === "routed" && counts.routed_pruned ? `${label} (${counts.routed_pruned} pruned)` : label;
  }

  function memory(study) {
    if (!study.memory) return null; // a plain Optuna study: vramtune ran none of its trials
    const shown = MEMORY_ORDER.filter(([key]) => study.memory[key]);
    if (!shown.length) return el("span", { class: "muted", text: "–" });
    return el(
      "div",
      { class: "chips" },
      shown.map(([key, label]) =>
        el("span", { class: `chip chip-mem-${key}`, "data-memory": key, title: MEMORY_TITLES[key] }, el("b", { text: study.memory[key] }), ` ${memoryLabel(study.memory, key, label)}`),
      ),
    );
  }

  function actions(study, refresh) {
    if (!study.task) return null; // a plain Optuna study: vramtune does not manage it
    const path = `/studies/${encodeURIComponent(study.name)}`;
    const act = async (button, method, suffix, confirmText) => {
      if (confirmText && !window.confirm(confirmText)) return;
      button.disabled = true;
      try {
        await VT.api(path + suffix, { method });
      } catch (error) {
        window.alert(`${study.name}: ${error.message}`);
      }
      refresh.now();
    };
    const buttons = [];
    if (VT.can("submit") && study.state === "running") {
      buttons.push(el("button", { class: "small", type: "button", "data-action": "pause", onclick: (e) => act(e.target, "POST", "/pause"), text: "Pause" }));
    }
    if (VT.can("submit") && study.state === "paused") {
      buttons.push(el("button", { class: "small", type: "button", "data-action": "resume", onclick: (e) => act(e.target, "POST", "/resume"), text: "Resume" }));
    }
    if (VT.can("admin")) {
      buttons.push(
        el("button", {
          class: "small danger",
          type: "button",
          "data-action": "delete",
          onclick: (e) => act(e.target, "DELETE", "", `Delete study "${study.name}" and all its trials?`),
          text: "Delete",
        }),
      );
    }
    return el("div", { class: "chips" }, buttons);
  }

  function render(refresh) {
    if (!latest) return;
    const needle = document.getElementById("study-filter").value.trim().toLowerCase();
    const shown = latest.studies.filter(
      (s) => !needle || s.name.toLowerCase().includes(needle) || (s.task || "").toLowerCase().includes(needle),
    );
    const rows = shown.map((s) =>
      el(
        "tr",
        { "data-study": s.name },
        el("td", { class: "name" }, studyLink(s.name)),
        el("td", { text: s.task || "optuna" }),
        el("td", {}, VT.badge(s.state)),
        el("td", {}, progress(s)),
        el("td", {}, counts(s)),
        el("td", { "data-col": "memory" }, memory(s)),
        el("td", { class: "num", text: VT.value(s.best_value) }),
        el("td", { class: "num", text: VT.rate(s.trials_per_hour) }),
        el("td", { class: "num", text: s.running }),
        el("td", { class: "muted", text: VT.ago(s.last_activity, latest.now) }),
        el("td", {}, actions(s, refresh)),
      ),
    );
    fill(document.querySelector("#studies tbody"), rows);
    document.getElementById("studies-empty").textContent = latest.studies.length
      ? shown.length ? "" : "No study matches the filter."
      : "No studies yet: create one with `vramtune study create` or POST /api/v1/studies.";
    document.getElementById("study-count").textContent = `${shown.length} of ${latest.studies.length}`;
    const running = latest.studies.reduce((n, s) => n + s.running, 0);
    fill(
      document.getElementById("studies-meta"),
      el("span", {}, el("b", { text: latest.studies.length }), " studies"),
      el("span", {}, el("b", { text: running }), " trials running"),
    );
  }

  async function main() {
    const scopes = VT.start("studies"); // in parallel with the data: only buttons wait for it
    const refresh = VT.poll(async () => {
      latest = await VT.api("/dashboard/studies");
      render(refresh);
    }, 3000);
    await scopes;
    render(refresh);
    document.getElementById("study-filter").addEventListener("input", () => render(refresh));
    VT.onAuthChange(() => refresh.now());
  }

  main().catch((error) => VT.errorBox(document.querySelector("main"), error));
})();

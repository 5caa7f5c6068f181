// vramtune dashboard: what every page shares. No framework, no build step.
// Every user-supplied string reaches the page through textContent, never innerHTML.
"use strict";

const VT = (() => {
  const API = "/api/v1";
  const TOKEN_KEY = "vramtune.token";
  const REQUEST_TIMEOUT_MS = 30000;
  const ALL_SCOPES = ["admin", "submit", "worker", "read"];
  let scopes = null; // the token's scopes once known; all of them when auth is off
  let authOff = false;
  const authListeners = [];

  // ------------------------------------------------------------------ DOM

  /** An element with attributes and children; strings become text nodes (never HTML). */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = String(value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    append(node, children);
    return node;
  }

  function append(node, children) {
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  /** Replace a node's children. */
  function fill(node, ...children) {
    node.replaceChildren();
    return append(node, children);
  }

  // ------------------------------------------------------------------ formatting

  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    let value = Number(n);
    let unit = 0;
    while (Math.abs(value) >= 1024 && unit < UNITS.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return `${value.toFixed(value >= 100 || unit === 0 ? 0 : value >= 10 ? 1 : 2)} ${UNITS[unit]}`;
  }

  /** The unit in which to plot byte values (the largest one keeps numbers readable). */
  function byteScale(values) {
    const top = Math.max(0, ...values.filter((v) => v !== null));
    const unit = top >= 2 * 1024 ** 3 ? 3 : top >= 2 * 1024 ** 2 ? 2 : top >= 2048 ? 1 : 0;
    return { name: UNITS[unit], div: 1024 ** unit };
  }

  // Peaks spanning two decades or more (2 MiB runs beside 2 GiB ones) go on a log axis: on a
  // linear one every small run sits on the axis.
  const LOG_SPAN = 100;

  /** "log" when the positive ``values`` span LOG_SPAN or more, else "linear". */
  function spanType(values) {
    const positive = values.filter((v) => v > 0);
    if (!positive.length) return "linear";
    return Math.max(...positive) / Math.min(...positive) >= LOG_SPAN ? "log" : "linear";
  }

  /** An axis title, its unit and "log" when the axis is logarithmic. */
  function axisTitle(name, unit, type) {
    return `${name} (${type === "log" ? `${unit}, log` : unit})`;
  }

  // How num() writes the numbers that are not finite, by their String().
  const NON_FINITE = { Infinity: "∞", "-Infinity": "−∞", NaN: "NaN" };

  function num(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    if (!Number.isFinite(v)) return NON_FINITE[String(v)];
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    const abs = Math.abs(v);
    if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return v.toExponential(3);
    return String(Number(v.toPrecision(5)));
  }

  /** An objective value. JSON has no infinity nor NaN: those come as the strings "Infinity",
   * "-Infinity" and "NaN" (vramtune.service.wire.ObjectiveValue), which Number() reads. */
  function value(v) {
    return num(typeof v === "string" && Object.hasOwn(NON_FINITE, v) ? Number(v) : v);
  }

  /** A rate per hour: whole numbers from 100 up, one decimal below ("–" when unknown). */
  function rate(perHour) {
    if (perHour === null || perHour === undefined) return "–";
    return perHour >= 100 ? Math.round(perHour).toLocaleString("en-US") : perHour.toFixed(1);
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
    if (seconds < 60) return `${seconds.toFixed(1)} s`;
    const m = Math.floor(seconds / 60);
    if (m < 60) return `${m} min ${Math.round(seconds % 60)} s`;
    return `${Math.floor(m / 60)} h ${m % 60} min`;
  }

  function ago(iso, now) {
    if (!iso) return "–";
    const seconds = Math.max(0, ((now ? new Date(now) : new Date()) - new Date(iso)) / 1000);
    if (seconds < 60) return `${Math.round(seconds)} s ago`;
    if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
    if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
    return new Date(iso).toLocaleString();
  }

  function badge(state) {
    return el("span", { class: `badge badge-${String(state).toLowerCase().replace(/[^a-z]+/g, "-")}`, text: state });
  }

  // ------------------------------------------------------------------ HTTP and auth

  class HttpError extends Error {
    constructor(status, detail) {
      super(detail || `HTTP ${status}`);
      this.status = status;
    }
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  /** A JSON call to the API with the session's token; 401 opens the login box. */
  async function api(path, options = {}) {
    const headers = { Accept: "application/json" };
    const stored = token();
    if (stored) headers.Authorization = `Bearer ${stored}`;
    const response = await fetch(API + path, {
      method: options.method || "GET",
      headers,
      cache: "no-store",
      credentials: "omit",
      signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
    });
    if (response.status === 401 && !options.quiet401) {
      showLogin(stored ? "The token was refused: enter another one." : "This server needs a token.");
    }
    if (!response.ok) throw new HttpError(response.status, await errorDetail(response));
    return response.status === 204 ? null : response.json();
  }

  async function errorDetail(response) {
    try {
      const body = await response.json();
      if (typeof body.detail === "string") return body.detail;
      if (Array.isArray(body.detail)) return body.detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
    } catch (_) {
      // not JSON: fall through to the status line
    }
    return `HTTP ${response.status}`;
  }

  /** Learn the token's scopes; a server without /auth/whoami (404) has no auth at all. */
  async function loadScopes() {
    try {
      const me = await api("/auth/whoami", { quiet401: true });
      scopes = me.scopes || [];
      // Only a server with auth off answers whoami without a token.
      authOff = !token();
      renderAuth(me.name);
    } catch (error) {
      if (error.status === 404) {
        scopes = ALL_SCOPES;
        authOff = true;
        renderAuth(null);
      } else if (error.status === 401) {
        scopes = [];
        renderAuth(null);
        showLogin(token() ? "The token was refused: enter another one." : "This server needs a token.");
      } else {
        throw error;
      }
    }
  }

  /** Whether the token may do what needs ``scope`` (admin may do everything). */
  function can(scope) {
    return scopes !== null && (scopes.includes(scope) || scopes.includes("admin"));
  }

  function onAuthChange(listener) {
    authListeners.push(listener);
  }

  async function setToken(value) {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
    await loadScopes();
    for (const listener of authListeners) listener();
  }

  function renderAuth(name) {
    const box = document.getElementById("auth");
    if (!box) return;
    if (authOff) {
      fill(box, el("span", { class: "muted", title: "The server runs with VRAMTUNE_AUTH=off", text: "auth off" }));
      return;
    }
    if (token()) {
      fill(
        box,
        el("span", { class: "who", text: `${name || "token"} · ${scopes.join(", ") || "no scopes"}` }),
        el("button", { class: "link", type: "button", onclick: () => setToken(null), text: "Sign out" }),
      );
    } else {
      fill(box, el("button", { class: "link", type: "button", onclick: () => showLogin(""), text: "Sign in" }));
    }
  }

  function showLogin(message) {
    let overlay = document.getElementById("login");
    if (overlay) {
      overlay.querySelector(".login-message").textContent = message;
      return;
    }
    const input = el("input", { type: "password", name: "token", autocomplete: "off", placeholder: "vt_…", required: true, "aria-label": "API token" });
    const form = el(
      "form",
      {
        class: "login-box",
        onsubmit: async (event) => {
          event.preventDefault();
          overlay.remove();
          await setToken(input.value.trim());
        },
      },
      el("h2", { text: "Sign in" }),
      el("p", { class: "login-message", text: message }),
      el("p", { class: "muted", text: "Paste an API token with the read scope. It is kept for this tab only." }),
      input,
      el("div", { class: "login-actions" }, el("button", { type: "submit", class: "primary", text: "Sign in" })),
    );
    overlay = el("div", { id: "login", class: "overlay", role: "dialog", "aria-modal": "true" }, form);
    document.body.append(overlay);
    input.focus();
  }

  // ------------------------------------------------------------------ live updates

  /**
   * Call ``task`` now and again ``intervalMs`` after each call ends: calls never overlap (a slow
   * answer delays the next request instead of piling them up), and a hidden tab is not polled.
   */
  function poll(task, intervalMs) {
    let timer = null;
    let running = false;
    let again = false;
    async function tick() {
      clearTimeout(timer);
      if (running) {
        again = true;
        return;
      }
      if (document.hidden) return;
      running = true;
      try {
        await task();
        liveStatus("live");
        notice(null);
      } catch (error) {
        // No token yet (or a refused one): the sign-in box is open; nothing failed.
        liveStatus(error.status === 401 ? "signin" : "error", error.message);
        if (error.status === 403) notice(`This token may not see this page: ${error.message}`);
        else if (error.status !== 401) console.warn("vramtune: refresh failed:", error.message);
      } finally {
        running = false;
        if (again) {
          again = false;
          tick();
        } else {
          timer = setTimeout(tick, intervalMs);
        }
      }
    }
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) tick();
    });
    tick();
    return { now: tick };
  }

  /** A message under the header (null hides it). */
  function notice(message) {
    let node = document.getElementById("notice");
    if (!message) return node && node.remove();
    if (!node) {
      node = el("div", { id: "notice", class: "notice", role: "alert" });
      document.querySelector("main").prepend(node);
    }
    node.textContent = message;
  }

  function liveStatus(kind, message) {
    const node = document.getElementById("live");
    if (!node) return;
    node.className = `live live-${kind}`;
    node.title = message || "";
    const said = { live: `updated ${new Date().toLocaleTimeString()}`, signin: "sign in to see updates" };
    node.textContent = said[kind] || "update failed";
  }

  // ------------------------------------------------------------------ page frame

  /** The header (brand, navigation, live status, sign-in), then the token's scopes. */
  async function start(active) {
    const nav = [
      ["studies", "/", "Studies"],
      ["fleet", "/fleet", "Fleet"],
    ];
    const header = document.getElementById("top");
    fill(
      header,
      el("a", { class: "brand", href: "/" }, el("span", { class: "brand-mark", text: "▮" }), "vramtune"),
      el("nav", {}, nav.map(([key, href, label]) => el("a", { href, class: key === active ? "active" : "", text: label }))),
      el("span", { id: "live", class: "live", text: "" }),
      el("span", { id: "auth", class: "auth" }),
    );
    try {
      await loadScopes();
    } catch (error) {
      // the pages still show data; only the write buttons stay hidden
      console.warn("vramtune: could not learn the token's scopes:", error.message);
    }
  }

  function errorBox(node, error) {
    fill(node, el("div", { class: "error", text: error.message }));
  }

  // ------------------------------------------------------------------ plots

  const COLORS = ["#4f6bed", "#e8743b", "#19a979", "#945ecf", "#ed4a7b", "#13a4b4", "#bf399e", "#6c8893"];

  /** Draw (or redraw in place) a plot; one without points shows ``empty`` instead. */
  function plot(node, spec, empty) {
    const hasPoints = spec.traces.some((t) => t.x.length > 0);
    const message = node.parentElement.querySelector(".empty");
    if (message) message.textContent = hasPoints ? "" : empty;
    node.classList.toggle("hidden", !hasPoints);
    if (hasPoints) Plot.draw(node, spec);
    else node.dataset.points = "0";
  }

  return {
    api, can, onAuthChange, poll, start, el, fill, bytes, byteScale, spanType, axisTitle, num, value, rate, duration, ago,
    badge, errorBox, plot, COLORS, HttpError,
  };
})();

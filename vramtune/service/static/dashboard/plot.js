// vramtune dashboard: a small canvas plotter (scatter, lines, step lines, horizontal bars).
// Loading plotly.js costs over 2 s of CPU on a 2-core machine before the first plot; this draws
// a thousand points in a few milliseconds. Text that comes from users (legend names, axis
// titles, hover text) goes into the DOM through textContent; canvas text is never markup.
"use strict";

const Plot = (() => {
  const MARGIN = { left: 64, right: 16, top: 12, bottom: 40 };
  const GRID = "#e6e9f0";
  const AXIS = "#9aa3b5";
  const INK = "#4a5568";
  const FONT = "11px system-ui, -apple-system, 'Segoe UI', sans-serif";
  const HOVER_PX = 9;
  const states = new WeakMap();

  // ---------------------------------------------------------------- scales

  function extent(values, log) {
    let low = Infinity;
    let high = -Infinity;
    for (const v of values) {
      if (v === null || v === undefined || !Number.isFinite(v) || (log && v <= 0)) continue;
      if (v < low) low = v;
      if (v > high) high = v;
    }
    return low <= high ? [low, high] : null;
  }

  function padded([low, high], axis) {
    if (axis.type === "log") {
      const a = Math.log10(low);
      const b = Math.log10(high);
      const pad = a === b ? 0.5 : (b - a) * 0.05;
      return [10 ** (a - pad), 10 ** (b + pad)];
    }
    if (low === high) return [low - (Math.abs(low) || 1) * 0.5, high + (Math.abs(high) || 1) * 0.5];
    const pad = (high - low) * 0.05;
    return [axis.zero && low >= 0 ? 0 : low - pad, high + pad];
  }

  function scale(axis, [low, high], from, to) {
    if (axis.type === "log") {
      const a = Math.log10(low);
      const b = Math.log10(high);
      return (v) => from + ((Math.log10(v) - a) / (b - a || 1)) * (to - from);
    }
    return (v) => from + ((v - low) / (high - low || 1)) * (to - from);
  }

  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const power = 10 ** Math.floor(Math.log10(raw));
    const unit = raw / power;
    // The nearest of 1, 2, 5, 10: rounding up to the next one left as few as two ticks.
    return (unit >= 7 ? 10 : unit >= 3 ? 5 : unit >= 1.5 ? 2 : 1) * power;
  }

  /** Tick values and labels, about one per ``gap`` pixels (labels side by side need more). */
  function ticks(axis, [low, high], pixels, gap) {
    if (axis.ticks) return axis.ticks.filter(([v]) => v >= low && v <= high);
    const count = Math.max(2, Math.floor(pixels / gap));
    if (axis.type === "log") {
      const out = [];
      for (let e = Math.floor(Math.log10(low)); e <= Math.ceil(Math.log10(high)); e++) {
        for (const m of [1, 2, 5]) {
          const v = m * 10 ** e;
          if (v >= low && v <= high) out.push([v, label(v)]);
        }
      }
      return out.length > count * 1.5 ? out.filter(([v]) => Math.abs(Math.log10(v) % 1) < 1e-9) : out;
    }
    // An integer axis (trial numbers) never ticks between whole numbers.
    const step = axis.integer ? Math.max(1, niceStep(high - low, count)) : niceStep(high - low, count);
    const out = [];
    for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-9; v += step) {
      out.push([Math.abs(v) < step * 1e-9 ? 0 : v, label(Math.abs(v) < step * 1e-9 ? 0 : v, step)]);
    }
    return out;
  }

  function label(v, step) {
    const abs = Math.abs(v);
    if (abs !== 0 && (abs >= 1e5 || abs < 1e-3)) return v.toExponential(1).replace("e+", "e");
    const digits = step ? Math.max(0, -Math.floor(Math.log10(step))) : 3;
    return String(Number(v.toFixed(Math.min(digits, 6))));
  }

  // ---------------------------------------------------------------- markers

  function marker(ctx, symbol, x, y, r) {
    ctx.beginPath();
    switch (symbol) {
      case "diamond":
        ctx.moveTo(x, y - r * 1.3); ctx.lineTo(x + r * 1.3, y); ctx.lineTo(x, y + r * 1.3); ctx.lineTo(x - r * 1.3, y); ctx.closePath();
        return "fill";
      case "square":
        ctx.rect(x - r, y - r, 2 * r, 2 * r);
        return "fill";
      case "triangle":
        ctx.moveTo(x, y - r * 1.3); ctx.lineTo(x + r * 1.2, y + r); ctx.lineTo(x - r * 1.2, y + r); ctx.closePath();
        return "fill";
      case "x":
        ctx.moveTo(x - r, y - r); ctx.lineTo(x + r, y + r); ctx.moveTo(x + r, y - r); ctx.lineTo(x - r, y + r);
        return "stroke";
      case "star":
        for (let i = 0; i < 3; i++) {
          const a = (i * Math.PI) / 3;
          ctx.moveTo(x + Math.cos(a) * r * 1.3, y + Math.sin(a) * r * 1.3);
          ctx.lineTo(x - Math.cos(a) * r * 1.3, y - Math.sin(a) * r * 1.3);
        }
        return "stroke";
      case "open":
        ctx.arc(x, y, r, 0, 2 * Math.PI);
        return "stroke";
      default:
        ctx.arc(x, y, r, 0, 2 * Math.PI);
        return "fill";
    }
  }

  // ---------------------------------------------------------------- frame

  function frame(node) {
    let state = states.get(node);
    if (state) return state;
    node.replaceChildren();
    const canvas = document.createElement("canvas");
    const tip = document.createElement("div");
    tip.className = "plot-tip hidden";
    const xTitle = document.createElement("div");
    xTitle.className = "axis-title axis-x";
    const yTitle = document.createElement("div");
    yTitle.className = "axis-title axis-y";
    const legend = document.createElement("div");
    legend.className = "legend";
    const area = document.createElement("div");
    area.className = "plot-area";
    area.append(canvas, tip, xTitle, yTitle);
    node.append(area, legend);
    state = { canvas, tip, xTitle, yTitle, legend, area, spec: null, view: null, drag: null, hits: [] };
    states.set(node, state);
    canvas.addEventListener("mousemove", (e) => hover(node, state, e));
    canvas.addEventListener("mouseleave", () => state.tip.classList.add("hidden"));
    canvas.addEventListener("mousedown", (e) => {
      state.drag = { x: e.offsetX, y: e.offsetY, moved: false };
    });
    canvas.addEventListener("mouseup", (e) => release(node, state, e));
    canvas.addEventListener("dblclick", () => {
      state.view = null;
      render(node, state);
    });
    new ResizeObserver(() => state.spec && requestAnimationFrame(() => render(node, state))).observe(area);
    return state;
  }

  /** Draw ``spec`` into ``node`` (again, in place, keeping the user's zoom if asked). */
  function draw(node, spec) {
    const state = frame(node);
    if (!spec.keepView) state.view = null;
    state.spec = spec;
    renderLegend(state, spec);
    state.xTitle.textContent = spec.x.title || "";
    state.yTitle.textContent = spec.y.title || "";
    render(node, state);
  }

  function renderLegend(state, spec) {
    const items = spec.traces.filter((t) => t.name && spec.legend !== false);
    state.legend.replaceChildren(
      ...items.map((t) => {
        const item = document.createElement("span");
        item.className = "legend-item";
        const swatch = document.createElement("span");
        swatch.className = `swatch swatch-${t.mode === "lines" ? "line" : t.symbol || "circle"}`;
        swatch.style.setProperty("--c", t.color);
        const name = document.createElement("span");
        name.textContent = t.name;
        item.append(swatch, name);
        return item;
      }),
    );
  }

  function domains(spec, view) {
    if (view) return view;
    const xs = [];
    const ys = [];
    for (const t of spec.traces) {
      if (t.mode === "bars") {
        xs.push(0, ...t.x);
        ys.push(-0.5, t.y.length - 0.5);
      } else {
        xs.push(...t.x);
        ys.push(...t.y);
      }
    }
    const fixedX = spec.x.range;
    const fixedY = spec.y.range;
    const ex = fixedX || extent(xs, spec.x.type === "log");
    const ey = fixedY || extent(ys, spec.y.type === "log");
    if (!ex || !ey) return null;
    return { x: fixedX || padded(ex, spec.x), y: fixedY || padded(ey, spec.y) };
  }

  function render(node, state) {
    const spec = state.spec;
    const { canvas, area } = state;
    const width = area.clientWidth;
    const height = area.clientHeight;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.max(1, Math.round(width * ratio));
    canvas.height = Math.max(1, Math.round(height * ratio));
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    state.hits = [];
    const d = domains(spec, state.view);
    if (!d || width < 50 || height < 50) return;
    const left = spec.marginLeft || MARGIN.left;
    const box = { l: left, r: width - MARGIN.right, t: MARGIN.top, b: height - MARGIN.bottom };
    const sx = scale(spec.x, d.x, box.l, box.r);
    const sy = scale(spec.y, d.y, box.b, box.t);
    state.frame = { box, sx, sy, d };
    axes(ctx, spec, d, box, sx, sy);
    ctx.save();
    ctx.beginPath();
    ctx.rect(box.l, box.t, box.r - box.l, box.b - box.t);
    ctx.clip();
    let drawn = 0;
    for (const [index, t] of spec.traces.entries()) drawn += trace(ctx, t, index, sx, sy, state);
    ctx.restore();
    for (const t of spec.traces) if (t.labels) barLabels(ctx, t, sy, left);
    node.dataset.points = String(drawn);
    node.dataset.xTicks = ticks(spec.x, d.x, box.r - box.l, 60).map(([, text]) => text).join(" ");
  }

  function axes(ctx, spec, d, box, sx, sy) {
    ctx.font = FONT;
    ctx.lineWidth = 1;
    ctx.fillStyle = "#fbfcfe";
    ctx.fillRect(box.l, box.t, box.r - box.l, box.b - box.t);
    ctx.fillStyle = INK;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const [v, text] of ticks(spec.x, d.x, box.r - box.l, 60)) {
      const x = Math.round(sx(v)) + 0.5;
      if (spec.x.grid !== false) line(ctx, x, box.t, x, box.b, GRID);
      ctx.fillText(text, x, box.b + 5);
    }
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const [v, text] of ticks(spec.y, d.y, box.b - box.t, 50)) {
      const y = Math.round(sy(v)) + 0.5;
      if (spec.y.grid !== false) line(ctx, box.l, y, box.r, y, GRID);
      ctx.fillText(clip(ctx, text, box.l - 26), box.l - 6, y);
    }
    line(ctx, box.l + 0.5, box.t, box.l + 0.5, box.b, AXIS);
    line(ctx, box.l, box.b + 0.5, box.r, box.b + 0.5, AXIS);
  }

  function clip(ctx, text, room) {
    if (ctx.measureText(text).width <= room) return text;
    let cut = text;
    while (cut.length > 1 && ctx.measureText(`${cut}…`).width > room) cut = cut.slice(0, -1);
    return `${cut}…`;
  }

  function line(ctx, x0, y0, x1, y1, color) {
    ctx.strokeStyle = color;
    ctx.beginPath();
    ctx.moveTo(x0, y0);
    ctx.lineTo(x1, y1);
    ctx.stroke();
  }

  function trace(ctx, t, index, sx, sy, state) {
    const color = t.color || "#4f6bed";
    if (t.mode === "bars") return bars(ctx, t, index, sx, sy, state, color);
    const points = [];
    for (let i = 0; i < t.x.length; i++) {
      const x = t.x[i];
      const y = t.y[i];
      if (x === null || y === null || !Number.isFinite(x) || !Number.isFinite(y)) continue;
      points.push([sx(x), sy(y), i]);
    }
    if (t.mode === "lines" || t.mode === "lines+markers") {
      ctx.strokeStyle = color;
      ctx.lineWidth = t.width || 2;
      ctx.setLineDash(t.dash ? [5, 4] : []);
      ctx.beginPath();
      points.forEach(([x, y], k) => {
        if (k === 0) ctx.moveTo(x, y);
        else if (t.shape === "hv") {
          ctx.lineTo(x, points[k - 1][1]);
          ctx.lineTo(x, y);
        } else if (t.shape === "vh") {
          ctx.lineTo(points[k - 1][0], y);
          ctx.lineTo(x, y);
        } else ctx.lineTo(x, y);
      });
      ctx.stroke();
      ctx.setLineDash([]);
    }
    if (t.mode !== "lines") {
      ctx.globalAlpha = t.opacity ?? 0.7;
      ctx.fillStyle = color;
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      const r = (t.size || 6) / 2;
      for (const [x, y] of points) {
        if (marker(ctx, t.symbol, x, y, r) === "fill") ctx.fill();
        else ctx.stroke();
      }
      ctx.globalAlpha = 1;
    }
    if (t.hover) for (const [x, y, i] of points) state.hits.push({ x, y, t, i, index });
    return points.length;
  }

  function bars(ctx, t, index, sx, sy, state, color) {
    ctx.fillStyle = color;
    const half = Math.abs(sy(0) - sy(1)) * 0.35;
    for (let i = 0; i < t.x.length; i++) {
      const y = sy(i);
      const x0 = sx(0);
      const x1 = sx(t.x[i]);
      ctx.fillRect(Math.min(x0, x1), y - half, Math.abs(x1 - x0), 2 * half);
      state.hits.push({ x: x1, y, t, i, index, bar: { x0, x1, y0: y - half, y1: y + half } });
    }
    return t.x.length;
  }

  /** A bar chart's category names, left of the plot area (outside its clip). */
  function barLabels(ctx, t, sy, left) {
    ctx.font = FONT;
    ctx.fillStyle = INK;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i < t.labels.length; i++) ctx.fillText(clip(ctx, t.labels[i], left - 10), left - 6, sy(i));
  }

  // ---------------------------------------------------------------- interaction

  function nearest(state, px, py) {
    let best = null;
    let bestDistance = HOVER_PX * HOVER_PX;
    for (const hit of state.hits) {
      if (hit.bar) {
        const b = hit.bar;
        if (px >= Math.min(b.x0, b.x1) - 2 && px <= Math.max(b.x0, b.x1) + 2 && py >= b.y0 && py <= b.y1) return hit;
        continue;
      }
      const dx = hit.x - px;
      const dy = hit.y - py;
      const distance = dx * dx + dy * dy;
      if (distance <= bestDistance) {
        best = hit;
        bestDistance = distance;
      }
    }
    return best;
  }

  function hover(node, state, event) {
    if (state.drag) {
      state.drag.moved = Math.abs(event.offsetX - state.drag.x) + Math.abs(event.offsetY - state.drag.y) > 4;
      if (state.drag.moved) return band(state, event);
    }
    const hit = nearest(state, event.offsetX, event.offsetY);
    state.canvas.style.cursor = hit && state.spec.onClick ? "pointer" : "crosshair";
    if (!hit) return state.tip.classList.add("hidden");
    state.tip.textContent = hit.t.hover(hit.i);
    state.tip.classList.remove("hidden");
    const room = state.area.clientWidth - state.tip.offsetWidth - 4;
    state.tip.style.left = `${Math.min(room, hit.x + 10)}px`;
    state.tip.style.top = `${Math.max(0, hit.y - state.tip.offsetHeight - 8)}px`;
  }

  function band(state, event) {
    render(state.area.parentElement, state);
    const ctx = state.canvas.getContext("2d");
    ctx.fillStyle = "rgba(79, 107, 237, 0.12)";
    ctx.strokeStyle = "rgba(79, 107, 237, 0.6)";
    const x = Math.min(state.drag.x, event.offsetX);
    const y = Math.min(state.drag.y, event.offsetY);
    ctx.fillRect(x, y, Math.abs(event.offsetX - state.drag.x), Math.abs(event.offsetY - state.drag.y));
    ctx.strokeRect(x, y, Math.abs(event.offsetX - state.drag.x), Math.abs(event.offsetY - state.drag.y));
  }

  function release(node, state, event) {
    const drag = state.drag;
    state.drag = null;
    if (drag && drag.moved && state.frame) return zoom(node, state, drag, event);
    const hit = nearest(state, event.offsetX, event.offsetY);
    if (hit && state.spec.onClick && hit.t.data) state.spec.onClick(hit.t.data[hit.i]);
  }

  /** Zoom to the dragged rectangle (double-click goes back). */
  function zoom(node, state, drag, event) {
    const { sx, sy, d, box } = state.frame;
    const invert = (axis, range, from, to) => (p) => {
      const f = (p - from) / (to - from);
      if (axis.type === "log") return 10 ** (Math.log10(range[0]) + f * (Math.log10(range[1]) - Math.log10(range[0])));
      return range[0] + f * (range[1] - range[0]);
    };
    const ix = invert(state.spec.x, d.x, box.l, box.r);
    const iy = invert(state.spec.y, d.y, box.b, box.t);
    const xs = [ix(drag.x), ix(event.offsetX)].sort((a, b) => a - b);
    const ys = [iy(drag.y), iy(event.offsetY)].sort((a, b) => a - b);
    if (sx && sy) state.view = { x: xs, y: ys };
    render(node, state);
  }

  return { draw };
})();

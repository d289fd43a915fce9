// The console's only script: it swaps in the live part of a page (the
// fleet's workers and residency) from the server every second. Pages work
// without it; it only spares the reload.
"use strict";

(function () {
  const live = document.querySelector("[data-live]");
  if (!live) {
    return;
  }
  const url = live.dataset.live;
  const every = Number(live.dataset.everyMs) || 1000;
  let busy = false;

  async function refresh() {
    if (busy || document.hidden) {
      return;
    }
    busy = true;
    try {
      const r = await fetch(url, { credentials: "same-origin", redirect: "manual" });
      if (r.type === "opaqueredirect" || r.status === 401) {
        // The session ended: let the page send us to sign in.
        window.location.reload();
        return;
      }
      if (r.ok) {
        live.innerHTML = await r.text();
        live.dataset.refreshedAt = String(Date.now());
      }
    } catch (e) {
      // The gateway is away for a moment; the next tick tries again.
    } finally {
      busy = false;
    }
  }

  window.setInterval(refresh, every);
})();

// A session's virtual display (issue 20): noVNC over the harness's RFB
// relay (docs/api.md, "The display over VNC"). Each connection asks
// POST /v1/sessions/{id}/display/rfb for a one-time viewer URL and opens
// it with noVNC's RFB; a reconnect asks for a new one (a ticket works
// once).
//
// The page starts **view only** (`rfb.viewOnly = true`): noVNC then sends
// no key or pointer event at all, so opening the page to watch an agent
// cannot disturb it by a stray click or keystroke. *Take over* sets
// `viewOnly = false` (the person's mouse and keyboard go to the display,
// alongside the agent's computer_action calls); *View only* gives it back.

import RFB from '../vendor/novnc/core/rfb.js';
import { post, seg } from '../api.js';
import { h, clear, errorText } from '../ui.js';

export const name = 'display';

/** The viewer URL on this page's own origin. The harness builds it from
 * `--public-url` or its listen address (what executors dial), which may
 * not be the name this browser used; the relay is served by the same
 * listener as this page, so only the path is kept (and the CSP's
 * `connect-src 'self'` allows exactly this origin). */
function viewerUrl(offered) {
  const at = offered.indexOf('/v1/relay/rfb/');
  if (at < 0) return offered;
  const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
  return `${proto}//${location.host}${offered.slice(at)}`;
}

/** A refusal of the POST, in words, with the harness's own message, HTTP
 * status, reason and JSON-RPC error code. */
function refusal(e) {
  const err = e && e.body && e.body.error;
  const detail = `${e && e.message ? e.message : e}${err && err.code !== undefined ? `, code ${err.code}` : ''}`;
  if (e && e.status === 501) {
    return `This session's executor does not offer its display over VNC (it needs Xvfb and x11vnc): ${detail}`;
  }
  if (e && (e.status === 404 || e.status === 410)) return `No display: the session is gone: ${detail}`;
  return `Cannot connect to the display: ${detail}`;
}

export function render(main, [sid]) {
  const base = `/v1/sessions/${seg(sid)}`;
  const state = h('span', { class: 'role', id: 'display-state', dataset: { state: 'connecting' } }, 'Connecting…');
  const take = h('button', { type: 'button', id: 'take-over', class: 'primary', 'aria-pressed': 'false' }, 'Take over');
  const scale = h('input', { type: 'checkbox', id: 'scale-to-fit', checked: true });
  const reconnect = h('button', { type: 'button', id: 'reconnect' }, 'Reconnect');
  const size = h('span', { id: 'display-size', class: 'muted' });
  const msg = h('div', { id: 'display-message' });
  const screen = h('div', { id: 'display' });
  main.append(
    h('h1', {}, 'Display of session ', h('a', { href: `#/sessions/${seg(sid)}` }, h('code', {}, sid))),
    h('div', { class: 'terminal-bar' }, state, take, h('label', {}, scale, ' Scale to fit'), reconnect, size),
    msg,
    screen,
  );

  let rfb = null;
  let control = false;
  // Connections counted, so a late answer or event of an older one is
  // ignored (and the test can wait for a fresh connection).
  let generation = 0;

  function show(s, text) {
    state.dataset.state = s;
    state.textContent = text;
    state.className = `role ${s === 'connected' ? (control ? 'writer' : 'reader') : ''}`;
    screen.dataset.state = s;
  }

  function showControl() {
    take.textContent = control ? 'View only' : 'Take over';
    take.setAttribute('aria-pressed', control ? 'true' : 'false');
    take.classList.toggle('primary', !control);
    screen.dataset.control = control ? '1' : '0';
    if (rfb) rfb.viewOnly = !control;
    if (state.dataset.state === 'connected') {
      show('connected', control ? 'Connected: you have the mouse and keyboard' : 'Connected: view only');
    }
  }

  // Each connection draws into a fresh element of its own, so the canvas
  // of an old one (noVNC removes it only once its socket has closed) is
  // never mistaken for the current one.
  function drop() {
    const r = rfb;
    rfb = null;
    if (r) {
      try {
        r.disconnect();
      } catch (_) {
        /* already disconnected */
      }
    }
    clear(screen);
    size.textContent = '';
    delete screen.dataset.width;
    delete screen.dataset.height;
  }

  async function connect() {
    drop();
    const gen = ++generation;
    clear(msg);
    show('connecting', 'Connecting…');
    let offer;
    try {
      offer = await post(`${base}/display/rfb`);
    } catch (e) {
      if (gen !== generation) return;
      show('error', 'Not connected');
      msg.append(errorText(refusal(e)));
      return;
    }
    if (gen !== generation) return;
    let r;
    try {
      // `binary`: the subprotocol websockify speaks; the relay echoes it.
      const view = h('div', { class: 'display-view' });
      screen.append(view);
      r = new RFB(view, viewerUrl(offer.url), { shared: true, wsProtocols: ['binary'] });
    } catch (e) {
      show('error', 'Not connected');
      msg.append(errorText(e));
      return;
    }
    r.viewOnly = !control;
    r.scaleViewport = scale.checked;
    r.background = '#000';
    r.addEventListener('connect', () => {
      if (gen !== generation) return;
      const canvas = screen.querySelector('canvas');
      if (canvas) {
        // The framebuffer's size (the canvas is scaled by CSS, not resized).
        screen.dataset.width = String(canvas.width);
        screen.dataset.height = String(canvas.height);
        size.textContent = `${canvas.width}×${canvas.height}`;
      }
      screen.dataset.connections = String(gen);
      show('connected', '');
      showControl();
      if (control) r.focus();
    });
    r.addEventListener('disconnect', (ev) => {
      if (gen !== generation) return;
      rfb = null;
      size.textContent = '';
      show('disconnected', 'Disconnected');
      clear(msg).append(
        errorText(
          ev.detail && ev.detail.clean
            ? 'The display stream ended (the session or its display stopped, or the harness closed it).'
            : 'The relay refused or lost the connection (a used or expired ticket, too many viewers, or the executor could not serve the display).',
        ),
      );
    });
    r.addEventListener('securityfailure', (ev) => {
      if (gen !== generation) return;
      clear(msg).append(errorText(`VNC security failure: ${(ev.detail && ev.detail.reason) || 'unknown'}`));
    });
    r.addEventListener('desktopname', (ev) => {
      if (gen !== generation) return;
      screen.title = (ev.detail && ev.detail.name) || '';
    });
    rfb = r;
  }

  take.addEventListener('click', () => {
    control = !control;
    showControl();
    if (control && rfb) rfb.focus();
  });
  scale.addEventListener('change', () => {
    if (rfb) rfb.scaleViewport = scale.checked;
  });
  reconnect.addEventListener('click', () => connect());

  showControl();
  connect();

  return () => {
    generation += 1;
    drop();
  };
}

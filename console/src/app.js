// The console's entry: asks the harness whether a login is needed, then
// routes `#/…` to one small page module. Each page renders into <main>
// and returns a cleanup function (it stops its polls and sockets).

import './xterm-csp.js';
import { get, post, setCsrf } from './api.js';
import { clear, errorText } from './ui.js';
import * as login from './pages/login.js';
import * as executors from './pages/executors.js';
import * as sessions from './pages/sessions.js';
import * as session from './pages/session.js';
import * as process from './pages/process.js';
import * as terminal from './pages/terminal.js';
import * as display from './pages/display.js';
import * as turn from './pages/turn.js';
import * as metrics from './pages/metrics.js';

const routes = [
  [/^\/login$/, login],
  [/^\/executors$/, executors],
  [/^\/sessions$/, sessions],
  [/^\/metrics$/, metrics],
  [/^\/sessions\/([^/]+)$/, session],
  [/^\/sessions\/([^/]+)\/processes\/([^/]+)$/, process],
  [/^\/sessions\/([^/]+)\/turns$/, turn],
  [/^\/sessions\/([^/]+)\/display$/, display],
  [/^\/executors\/([^/]+)\/terminals\/([^/]+)$/, terminal],
];

const main = document.getElementById('main');
let cleanup = null;
let state = null;

async function whoami() {
  state = await get('/console/session');
  setCsrf(state.csrf);
  const mode = document.getElementById('mode');
  mode.textContent = state.loopbackOnly
    ? 'No API token: this console is served on loopback only'
    : state.authenticated ? 'Logged in with the API token' : '';
  mode.dataset.loopbackOnly = state.loopbackOnly ? '1' : '0';
  document.getElementById('nav').hidden = !state.authenticated;
  document.getElementById('logout').hidden = !(state.tokenRequired && state.authenticated);
  return state;
}

async function route() {
  if (cleanup) {
    try {
      cleanup();
    } catch (_) {
      /* a page's cleanup must not stop the next page */
    }
    cleanup = null;
  }
  clear(main);
  const raw = location.hash.replace(/^#/, '') || '/executors';
  const [path, query] = raw.split('?');
  try {
    if (!state) await whoami();
  } catch (e) {
    main.append(errorText(e));
    return;
  }
  if (!state.authenticated && path !== '/login') {
    location.hash = '#/login';
    return;
  }
  for (const [re, page] of routes) {
    const m = path.match(re);
    if (m) {
      const params = m.slice(1).map(decodeURIComponent);
      document.body.dataset.page = page.name;
      cleanup = page.render(main, params, new URLSearchParams(query || ''), { refresh: whoami }) || null;
      return;
    }
  }
  main.append(errorText(`no page ${path}`));
}

document.getElementById('logout').addEventListener('click', async () => {
  try {
    await post('/console/logout');
  } finally {
    state = null;
    setCsrf(null);
    location.hash = '#/login';
    route();
  }
});

window.addEventListener('hashchange', route);
route();

// Executors: GET /v1/executors every 2 s (state, heartbeat age,
// capabilities, sessions), their terminals, and the actions on one: a new
// session, a new terminal, and drain (POST /v1/executors/{id}/drain, after
// a confirmation: the executor takes no new session, lets its sessions
// run until the deadline and then disconnects).

import { get, post, seg } from '../api.js';
import { h, ago, clear, errorText, every, stateTag } from '../ui.js';

export const name = 'executors';

function capabilityTags(caps) {
  const on = Object.entries(caps || {})
    .filter(([, v]) => v && typeof v === 'object' && (v.enabled === undefined || v.enabled))
    .map(([k]) => k)
    .sort();
  return on.length ? on.map((k) => h('span', { class: 'tag' }, k)) : h('span', { class: 'muted' }, 'none');
}

function terminalCapable(caps) {
  const t = caps && caps.terminal;
  return !!(t && (t.enabled === undefined || t.enabled));
}

export function render(main) {
  const msg = h('div');
  const body = h('div');
  main.append(h('h1', {}, 'Executors'), msg, body);
  let key = null;
  const ages = [];

  async function newSession(id) {
    try {
      const s = await post('/v1/sessions', { executorId: id });
      location.hash = `#/sessions/${seg(s.sessionId)}`;
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  }

  async function newTerminal(id) {
    try {
      const t = await post(`/v1/executors/${seg(id)}/terminals`, { cols: 100, rows: 30 });
      location.hash = `#/executors/${seg(id)}/terminals/${seg(t.terminalId)}?write=1`;
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  }

  async function drain(id) {
    if (!window.confirm(`Drain ${id}? It takes no new session, lets its sessions finish and then disconnects.`)) return;
    try {
      const r = await post(`/v1/executors/${seg(id)}/drain`, { reason: 'console' });
      clear(msg).append(h('p', { class: 'muted' }, `${id}: drain ${r.accepted ? 'accepted' : 'refused'}, ${r.activeSessions.length} session(s) still running`));
      key = null;
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  }

  async function draw(list) {
    const terminals = {};
    await Promise.all(
      list
        .filter((e) => terminalCapable(e.capabilities))
        .map(async (e) => {
          try {
            terminals[e.executorId] = (await get(`/v1/executors/${seg(e.executorId)}/terminals`)).terminals;
          } catch (_) {
            terminals[e.executorId] = [];
          }
        }),
    );
    const k = JSON.stringify([list.map((e) => ({ ...e, lastHeartbeatAt: null })), terminals]);
    if (k === key) return;
    key = k;
    ages.length = 0;
    clear(body);
    if (!list.length) {
      body.append(h('p', { class: 'muted', id: 'no-executors' }, 'No executor is connected.'));
      return;
    }
    const rows = list.map((e) => {
      const age = h('td', { class: 'heartbeat' }, ago(e.lastHeartbeatAt));
      ages.push([age, e.lastHeartbeatAt]);
      const terms = (terminals[e.executorId] || []).map((t) =>
        h('div', {}, h('a', { href: `#/executors/${seg(e.executorId)}/terminals/${seg(t.terminalId)}` }, t.terminalId), ' ', stateTag(t.state), h('span', { class: 'muted' }, ` ${t.viewers} viewer(s)`)),
      );
      return h(
        'tr',
        { dataset: { executor: e.executorId } },
        h('td', {}, h('strong', { class: 'executor-id' }, e.executorId), h('div', { class: 'muted' }, `${e.name} ${e.version} · protocol ${e.protocol || '?'}`)),
        h('td', {}, stateTag(e.state)),
        age,
        h('td', {}, ago(e.connectedAt)),
        h('td', {}, capabilityTags(e.capabilities)),
        h('td', {}, e.activeSessions.length ? e.activeSessions.map((s) => h('div', {}, h('a', { href: `#/sessions/${seg(s)}` }, s))) : h('span', { class: 'muted' }, 'none')),
        h('td', {}, terms.length ? terms : h('span', { class: 'muted' }, 'none')),
        h(
          'td',
          {},
          h('div', { class: 'row' },
            h('button', { type: 'button', class: 'new-session', onclick: () => newSession(e.executorId) }, 'New session'),
            terminalCapable(e.capabilities) && h('button', { type: 'button', class: 'new-terminal', onclick: () => newTerminal(e.executorId) }, 'Open terminal'),
            e.state !== 'draining' && h('button', { type: 'button', class: 'drain', onclick: () => drain(e.executorId) }, 'Drain'),
          ),
        ),
      );
    });
    body.append(
      h(
        'table',
        { id: 'executors' },
        h('thead', {}, h('tr', {}, ['Executor', 'State', 'Heartbeat', 'Connected', 'Capabilities', 'Sessions', 'Terminals', ''].map((t) => h('th', {}, t)))),
        h('tbody', {}, rows),
      ),
    );
  }

  return every(2000, async () => {
    try {
      const v = await get('/v1/executors');
      await draw(v.executors);
      for (const [cell, ts] of ages) cell.textContent = ago(ts);
      clear(msg);
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  });
}

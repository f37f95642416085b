// Sessions: GET /v1/sessions every 2 s, newest first.

import { get, post, seg } from '../api.js';
import { h, clear, errorText, every, stateTag } from '../ui.js';

export const name = 'sessions';

export function render(main) {
  const msg = h('div');
  const body = h('div');
  const create = h('button', { type: 'button', id: 'new-session', class: 'primary' }, 'New session');
  create.addEventListener('click', async () => {
    try {
      const s = await post('/v1/sessions', {});
      location.hash = `#/sessions/${seg(s.sessionId)}`;
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  });
  main.append(h('h1', {}, 'Sessions'), h('div', { class: 'row' }, create), msg, body);
  let key = null;
  return every(2000, async () => {
    try {
      const v = await get('/v1/sessions');
      const list = v.sessions.slice().sort((a, b) => String(b.createdAt).localeCompare(String(a.createdAt)));
      const k = JSON.stringify(list);
      if (k === key) return;
      key = k;
      clear(msg);
      clear(body);
      if (!list.length) {
        body.append(h('p', { class: 'muted' }, 'No sessions yet.'));
        return;
      }
      body.append(
        h(
          'table',
          { id: 'sessions' },
          h('thead', {}, h('tr', {}, ['Session', 'Executor', 'Fencing', 'State', 'Processes', 'MCP servers', 'Ended'].map((t) => h('th', {}, t)))),
          h(
            'tbody',
            {},
            list.map((s) =>
              h(
                'tr',
                { dataset: { session: s.sessionId } },
                h('td', {}, h('a', { href: `#/sessions/${seg(s.sessionId)}` }, s.sessionId)),
                h('td', {}, s.executorId || '—'),
                h('td', { class: 'mono' }, String(s.fencingToken)),
                h('td', {}, stateTag(s.state)),
                h('td', {}, String((s.processes || []).length)),
                h('td', {}, String((s.mcpServers || []).length)),
                h('td', {}, s.endedReason || ''),
              ),
            ),
          ),
        ),
      );
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  });
}

// One session: its lease (executor, fencing token, state), processes,
// tools and MCP servers; start a process (then its live view), stop the
// session.

import { get, post, del, seg } from '../api.js';
import { h, ago, clear, errorText, every, facts, stateTag } from '../ui.js';

export const name = 'session';

function toolTags(caps) {
  const t = caps && caps.tools;
  if (!t) return h('span', { class: 'muted' }, 'the executor does not say');
  return Object.entries(t).map(([k, v]) => h('span', { class: 'tag' }, `${k}: ${Array.isArray(v) ? v.join(', ') : typeof v === 'object' ? JSON.stringify(v) : v}`));
}

export function render(main, [sid]) {
  const base = `/v1/sessions/${seg(sid)}`;
  const msg = h('div');
  const info = h('div');
  const procs = h('div');
  const mcp = h('div');
  const command = h('input', { type: 'text', id: 'command', placeholder: 'command, run with sh -c', value: '' });
  const stdinOpen = h('input', { type: 'checkbox', id: 'stdin-open' });
  const start = h(
    'form',
    { class: 'row', id: 'start-process' },
    command,
    h('label', {}, stdinOpen, ' stdin open'),
    h('button', { type: 'submit', class: 'primary' }, 'Start process'),
  );
  start.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    if (!command.value.trim()) return;
    try {
      const p = await post(`${base}/processes`, {
        argv: ['sh', '-c', command.value],
        stdin: stdinOpen.checked ? 'open' : 'closed',
      });
      location.hash = `#/sessions/${seg(sid)}/processes/${seg(p.processId)}`;
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  });
  // A tool call (POST …/tools). The names suggested are the built-in
  // tools of PROTOCOL.md §6; any other name is sent as typed.
  const toolName = h('input', { type: 'text', id: 'tool-name', list: 'builtin-tools', value: 'bash', size: 10 });
  const toolInput = h('input', { type: 'text', id: 'tool-input', value: '{"command": "uname -a"}' });
  const toolResult = h('pre', { class: 'output', id: 'tool-result', hidden: true });
  const toolForm = h(
    'form',
    { class: 'row', id: 'call-tool' },
    toolName,
    h('datalist', { id: 'builtin-tools' }, ['bash', 'read', 'write', 'edit', 'glob', 'grep', 'list_files'].map((t) => h('option', { value: t }))),
    toolInput,
    h('button', { type: 'submit' }, 'Call tool'),
  );
  toolForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    let input;
    try {
      input = JSON.parse(toolInput.value || '{}');
    } catch (e) {
      clear(msg).append(errorText(`tool input: ${e.message}`));
      return;
    }
    toolResult.hidden = false;
    toolResult.textContent = '…';
    try {
      const r = await post(`${base}/tools`, { tool: toolName.value.trim(), input });
      const text = (r.content || []).map((c) => (c.type === 'text' ? c.text : `[${c.type}]`)).join('\n');
      toolResult.textContent = `${r.outcome}${r.isError ? ' (error)' : ''} in ${r.durationMs} ms\n${text}`;
    } catch (e) {
      toolResult.textContent = String(e.message || e);
    }
  });
  const stop = h('button', { type: 'button', class: 'danger', id: 'stop-session' }, 'Stop session');
  stop.addEventListener('click', async () => {
    stop.disabled = true;
    try {
      await del(base);
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  });
  // Agent turns: only when the executor offers agents.
  const agentLink = h('a', { href: `#/sessions/${seg(sid)}/turns`, id: 'agent-link', hidden: true }, 'Agent turns →');
  // The display (noVNC): only when the executor serves it over VNC.
  const displayLink = h('a', { href: `#/sessions/${seg(sid)}/display`, id: 'display-link', hidden: true }, 'Display →');
  main.append(
    h('h1', {}, 'Session ', h('code', {}, sid)),
    h('p', { class: 'row' }, agentLink, displayLink),
    msg,
    info,
    h('h2', {}, 'Processes'),
    start,
    procs,
    h('h2', {}, 'Tools'),
    toolForm,
    toolResult,
    h('h2', {}, 'MCP servers'),
    mcp,
    h('div', { class: 'row' }, stop),
  );

  let key = null;
  return every(2000, async () => {
    try {
      const s = await get(base);
      const executors = (await get('/v1/executors')).executors;
      const ex = executors.find((e) => e.executorId === s.executorId);
      let live = [];
      if (s.state !== 'ended') {
        try {
          live = (await get(`${base}/processes`)).processes;
        } catch (_) {
          live = [];
        }
      }
      const k = JSON.stringify([s, live, ex && ex.capabilities]);
      if (k === key) return;
      key = k;
      clear(msg);
      stop.disabled = s.state === 'ended';
      start.hidden = s.state === 'ended';
      toolForm.hidden = s.state === 'ended';
      const ag = ex && ex.capabilities && ex.capabilities.agent;
      agentLink.hidden = !(ag && ag.enabled && (ag.agents || []).length) || s.state === 'ended';
      const dp = ex && ex.capabilities && ex.capabilities.display;
      displayLink.hidden = !(dp && dp.rfb) || s.state === 'ended';
      clear(info).append(
        facts([
          ['Executor', h('a', { href: '#/executors' }, s.executorId)],
          ['Fencing token', h('span', { class: 'mono', id: 'fencing' }, String(s.fencingToken))],
          ['State', stateTag(s.state)],
          ['Ready', s.ready ? 'yes' : 'no'],
          ['Status', s.status ? `${s.status}${s.statusDetail ? ' — ' + s.statusDetail : ''}` : '—'],
          ['Created', `${s.createdAt} (${ago(s.createdAt)})`],
          ['Ended', s.endedAt ? `${s.endedAt}: ${s.endedReason || ''}` : '—'],
          ['Tool permissions', toolTags(ex && ex.capabilities)],
          ['Metadata', h('code', {}, JSON.stringify(s.metadata || {}))],
        ]),
      );
      const byId = new Map();
      for (const p of s.processes || []) byId.set(p.processId, p);
      for (const p of live) byId.set(p.processId, { ...byId.get(p.processId), ...p });
      const list = [...byId.values()];
      clear(procs).append(
        list.length
          ? h(
              'table',
              { id: 'processes' },
              h('thead', {}, h('tr', {}, ['Process', 'State', 'Exit', 'Reason'].map((t) => h('th', {}, t)))),
              h(
                'tbody',
                {},
                list.map((p) =>
                  h(
                    'tr',
                    {},
                    h('td', {}, h('a', { href: `#/sessions/${seg(sid)}/processes/${seg(p.processId)}` }, p.processId)),
                    h('td', {}, stateTag(p.state)),
                    h('td', {}, p.exitCode !== undefined && p.exitCode !== null ? String(p.exitCode) : p.exitSignal ? `signal ${p.exitSignal}` : ''),
                    h('td', {}, p.reason || ''),
                  ),
                ),
              ),
            )
          : h('p', { class: 'muted' }, 'No processes.'),
      );
      const servers = s.mcpServers || [];
      clear(mcp).append(
        servers.length
          ? h(
              'table',
              {},
              h('thead', {}, h('tr', {}, ['Server', 'Origin', 'State', 'Restarts', 'Error'].map((t) => h('th', {}, t)))),
              h('tbody', {}, servers.map((m) => h('tr', {}, h('td', {}, m.serverKey), h('td', {}, m.connectionOrigin), h('td', {}, stateTag(m.state)), h('td', {}, String(m.restarts || 0)), h('td', {}, m.lastError || m.reason || '')))),
            )
          : h('p', { class: 'muted' }, 'None.'),
      );
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  });
}

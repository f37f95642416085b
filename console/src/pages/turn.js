// Agent turns in a session: send a prompt (POST …/turns), follow the
// session's event stream (GET …/events, an EventSource: the cookie goes
// with it), print streamed text as its deltas come and the final event's
// text when it lands, show tool calls and their results, and answer
// permission questions with buttons (POST …/interactions/{id}).
// Shown only when the session's executor offers agents.

import { get, post, seg } from '../api.js';
import { h, clear, errorText } from '../ui.js';

export const name = 'turn';

function pretty(v) {
  if (v === undefined || v === null) return '';
  return typeof v === 'string' ? v : JSON.stringify(v);
}

function contentText(content) {
  if (!Array.isArray(content)) return pretty(content);
  return content.map((c) => (c && c.type === 'text' ? c.text : c && c.content && c.content.text ? c.content.text : pretty(c))).join('\n');
}

export function render(main, [sid]) {
  const base = `/v1/sessions/${seg(sid)}`;
  const msg = h('div');
  const status = h('span', { id: 'turn-status', class: 'muted' }, 'idle');
  const agent = h('select', { id: 'agent' });
  const prompt = h('input', { type: 'text', id: 'prompt', placeholder: 'a prompt for the agent' });
  const cancel = h('button', { type: 'button', id: 'cancel-turn', class: 'danger', disabled: true }, 'Cancel turn');
  const form = h('form', { class: 'row', id: 'prompt-form' }, agent, prompt, h('button', { type: 'submit', class: 'primary' }, 'Send'), cancel);
  const transcript = h('div', { id: 'transcript', class: 'transcript' });
  main.append(
    h('h1', {}, 'Agent in ', h('a', { href: `#/sessions/${seg(sid)}` }, sid)),
    h('p', {}, 'Turn: ', status),
    form,
    msg,
    transcript,
  );

  let turnId = null;
  const blocks = new Map(); // eventId / toolUseId / interactionId → element

  function block(key, cls, title) {
    let b = blocks.get(key);
    if (!b) {
      b = h('div', { class: `entry ${cls}` }, title ? h('div', { class: 'entry-title' }, title) : null, h('div', { class: 'entry-body' }));
      blocks.set(key, b);
      transcript.append(b);
      b.scrollIntoView({ block: 'end' });
    }
    return b;
  }

  const body = (b) => b.querySelector('.entry-body');

  function onEvent(item) {
    const e = item.event || {};
    switch (e.type) {
      case 'agent.message':
        body(block(item.eventId, 'message')).textContent = e.text || '';
        break;
      case 'agent.thinking':
        body(block(item.eventId, 'thinking', 'thinking')).textContent = e.text || '';
        break;
      case 'agent.tool_use': {
        const b = block(`tool-${e.toolUseId}`, 'tool', `tool ${e.name || ''} (${e.kind || 'other'})`);
        b.dataset.toolUseId = e.toolUseId;
        body(b).textContent = pretty(e.input);
        break;
      }
      case 'agent.tool_result': {
        const b = block(`tool-${e.toolUseId}`, 'tool', `tool ${e.toolUseId}`);
        b.dataset.status = e.status;
        b.append(h('div', { class: `tool-result ${e.status}` }, `${e.status}: ${contentText(e.content)}`));
        break;
      }
      case 'session.status_running':
        status.textContent = 'running';
        cancel.disabled = false;
        break;
      case 'session.status_idle': {
        const outcome = e.turnOutcome || (e.stopReason && e.stopReason.type) || 'idle';
        status.textContent = `idle (${outcome})`;
        status.dataset.outcome = outcome;
        cancel.disabled = true;
        break;
      }
      case 'session.error':
        transcript.append(errorText(`${(e.error && e.error.type) || 'error'}: ${(e.error && e.error.message) || ''}`));
        break;
      default:
        break;
    }
  }

  function onDelta(item) {
    if (item.eventType !== 'agent.message' && item.eventType !== 'agent.thinking') return;
    const b = block(item.eventId, item.eventType === 'agent.message' ? 'message' : 'thinking', item.eventType === 'agent.thinking' ? 'thinking' : null);
    body(b).textContent += item.text || '';
  }

  function showInteraction(i) {
    const key = `interaction-${i.interactionId}`;
    const b = block(key, 'interaction', `${i.kind}: ${i.toolName || ''}`);
    b.dataset.state = i.state;
    const bd = clear(body(b));
    bd.append(h('div', { class: 'mono' }, pretty(i.toolInput)));
    if (i.state === 'pending') {
      const answer = async (outcome) => {
        for (const btn of bd.querySelectorAll('button')) btn.disabled = true;
        try {
          showInteraction(await post(`${base}/interactions/${seg(i.interactionId)}`, { outcome }));
        } catch (e) {
          bd.append(errorText(e));
        }
      };
      bd.append(
        h('div', { class: 'row' },
          h('button', { type: 'button', class: 'primary allow', onclick: () => answer('allow') }, 'Allow'),
          h('button', { type: 'button', class: 'danger deny', onclick: () => answer('deny') }, 'Deny'),
        ),
      );
    } else {
      const how = i.outcome ? pretty(i.outcome.outcome || i.outcome) : i.reason || '';
      bd.append(h('div', { class: 'muted' }, `${i.state}${how ? ': ' + how : ''}`));
    }
  }

  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const text = prompt.value.trim();
    if (!text) return;
    prompt.value = '';
    transcript.append(h('div', { class: 'entry prompt' }, h('div', { class: 'entry-title' }, 'you'), h('div', { class: 'entry-body' }, text)));
    try {
      const body = { input: text };
      if (agent.value) body.config = { agent: agent.value };
      const r = await post(`${base}/turns`, body);
      turnId = r.turnId;
      clear(msg);
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  });
  cancel.addEventListener('click', async () => {
    if (!turnId) return;
    try {
      await post(`${base}/turns/${seg(turnId)}/cancel`, {});
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  });

  const es = new EventSource(`${base}/events`);
  const parse = (ev, fn) => {
    try {
      fn(JSON.parse(ev.data));
    } catch (_) {
      /* an item the page does not know */
    }
  };
  es.onmessage = (ev) => parse(ev, onEvent);
  es.addEventListener('delta', (ev) => parse(ev, onDelta));
  es.addEventListener('interaction', (ev) => parse(ev, (item) => showInteraction(item.interaction)));
  es.addEventListener('gap', (ev) => parse(ev, (g) => transcript.append(h('p', { class: 'gap' }, `[events ${g.from}–${g.to} were dropped by retention]`))));
  es.addEventListener('end', () => {
    status.textContent = 'session ended';
    es.close();
  });
  es.onopen = () => {
    main.dataset.streaming = '1';
  };

  get('/v1/executors')
    .then(async (v) => {
      const s = await get(base);
      const ex = v.executors.find((e) => e.executorId === s.executorId);
      const agents = (ex && ex.capabilities.agent && ex.capabilities.agent.agents) || [];
      for (const a of agents) agent.append(h('option', { value: a.name }, a.name));
      agent.hidden = agents.length < 2;
      // Interaction notices are not replayed: list what is pending.
      const pending = await get(`${base}/interactions`);
      for (const i of pending.interactions) showInteraction(i);
    })
    .catch((e) => clear(msg).append(errorText(e)));

  return () => es.close();
}

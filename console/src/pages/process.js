// A process's live output: one long poll per stream on
// GET …/output?cursor=&waitMs= (process.read), following nextCursor until
// eof. When the executor's ring dropped bytes before fromCursor (`gap`),
// a marker says how many. Plus stdin, interrupt and terminate.

import { get, post, seg } from '../api.js';
import { h, clear, errorText, stateTag } from '../ui.js';

export const name = 'process';

const MAX_SHOWN = 1 << 20; // characters kept on the page

function decode(b64, decoder) {
  const bin = atob(b64 || '');
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return decoder.decode(bytes, { stream: true });
}

export function render(main, [sid, pid]) {
  const base = `/v1/sessions/${seg(sid)}/processes/${seg(pid)}`;
  const msg = h('div');
  const state = h('span', { id: 'process-state' }, '…');
  const exit = h('span', { class: 'muted' });
  const out = h('pre', { class: 'output', id: 'output', 'aria-live': 'polite' });
  const stdin = h('input', { type: 'text', id: 'stdin', placeholder: 'a line for stdin' });
  const close = h('input', { type: 'checkbox', id: 'close-stdin' });
  const stdinForm = h('form', { class: 'row', id: 'stdin-form' }, stdin, h('label', {}, close, ' then close stdin'), h('button', { type: 'submit' }, 'Send'));
  const interrupt = h('button', { type: 'button', id: 'interrupt' }, 'Interrupt (SIGINT)');
  const terminate = h('button', { type: 'button', class: 'danger', id: 'terminate' }, 'Terminate');
  const controller = new AbortController();
  let shown = 0;

  function append(text, cls) {
    if (!text) return;
    out.append(cls ? h('span', { class: cls }, text) : document.createTextNode(text));
    shown += text.length;
    while (shown > MAX_SHOWN && out.firstChild) {
      shown -= out.firstChild.textContent.length;
      out.removeChild(out.firstChild);
    }
    out.scrollTop = out.scrollHeight;
  }

  async function act(fn) {
    try {
      const r = await fn();
      if (r && r.state) clear(state).append(stateTag(r.state));
      clear(msg);
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  }

  stdinForm.addEventListener('submit', (ev) => {
    ev.preventDefault();
    const text = stdin.value + '\n';
    stdin.value = '';
    act(() => post(`${base}/stdin`, { text, closeStdin: close.checked }));
  });
  interrupt.addEventListener('click', () => act(() => post(`${base}/interrupt`)));
  terminate.addEventListener('click', () => act(() => post(`${base}/terminate`, { graceMs: 2000 })));

  main.append(
    h('h1', {}, 'Process ', h('code', {}, pid), ' in ', h('a', { href: `#/sessions/${seg(sid)}` }, sid)),
    h('p', {}, 'State: ', state, ' ', exit),
    msg,
    out,
    stdinForm,
    h('div', { class: 'row' }, interrupt, terminate),
  );

  async function follow(stream) {
    const decoder = new TextDecoder();
    let cursor = 0;
    let failures = 0;
    while (!controller.signal.aborted) {
      let r;
      try {
        r = await get(`${base}/output?stream=${stream}&cursor=${cursor}&waitMs=20000`);
        failures = 0;
      } catch (e) {
        if (controller.signal.aborted) return;
        clear(msg).append(errorText(e));
        failures += 1;
        if (e.status && e.status < 500 && e.status !== 429) return;
        await new Promise((ok) => setTimeout(ok, Math.min(10000, 500 * 2 ** failures)));
        continue;
      }
      if (controller.signal.aborted) return;
      if (r.gap && r.fromCursor > cursor) {
        append(`\n[… ${r.fromCursor - cursor} bytes of ${stream} dropped by the executor's ring …]\n`, 'gap');
      }
      append(decode(r.data, decoder), stream === 'stderr' ? 'stderr' : null);
      cursor = r.nextCursor;
      clear(state).append(stateTag(r.state));
      if (r.eof) {
        append(decoder.decode());
        if (stream === 'stdout') {
          for (const b of [interrupt, terminate, ...stdinForm.querySelectorAll('input, button')]) b.disabled = true;
          const how = r.exitCode !== undefined && r.exitCode !== null ? `exit code ${r.exitCode}` : r.exitSignal ? `signal ${r.exitSignal}` : r.state;
          exit.id = 'exit';
          exit.textContent = `(${how})`;
        }
        return;
      }
    }
  }

  follow('stdout');
  follow('stderr');
  return () => controller.abort();
}

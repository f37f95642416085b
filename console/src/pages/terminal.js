// A terminal: xterm.js over the relay WebSocket
// (GET /v1/executors/{id}/terminals/{tid}/attach, subprotocol
// bmx.terminal.v1; docs/terminals.md). Binary frames: byte 0 op, bytes
// 1-8 seq (big-endian), then data; op 1 output, op 3 replayed chunk (empty
// = gap marker), op 2 input from us. Text frames are notices
// (attached/error/resized/exited) and our resize requests.
//
// The writer role is the attach's `write=1`: "Take control" re-attaches
// with it (the harness hands the role to the newest writer); "Read only"
// re-attaches without. A reader's keystrokes are not sent at all.

import { Terminal } from '../vendor/xterm.mjs';
import { FitAddon } from '../vendor/addon-fit.mjs';
import { get, del, seg } from '../api.js';
import { h, clear, errorText, stateTag } from '../ui.js';

export const name = 'terminal';

const OP_OUTPUT = 1;
const OP_INPUT = 2;
const OP_SNAPSHOT = 3;

function frame(op, data) {
  const out = new Uint8Array(9 + data.length);
  out[0] = op;
  out.set(data, 9);
  return out;
}

export function render(main, [eid, tid], query) {
  const path = `/v1/executors/${seg(eid)}/terminals/${seg(tid)}`;
  const wantWrite = query.get('write') === '1';
  const msg = h('div');
  const role = h('span', { class: 'role', id: 'role' }, 'connecting…');
  const status = h('span', { id: 'terminal-status', class: 'muted' });
  const take = h('button', { type: 'button', id: 'take-control', class: 'primary' }, 'Take control');
  const release = h('button', { type: 'button', id: 'read-only' }, 'Read only');
  const close = h('button', { type: 'button', class: 'danger', id: 'close-terminal' }, 'Close terminal');
  const screen = h('div', { id: 'terminal' });
  main.append(
    h('h1', {}, 'Terminal ', h('code', {}, tid), ' on ', h('a', { href: '#/executors' }, eid)),
    h('div', { class: 'terminal-bar' }, role, take, release, close, status),
    msg,
    screen,
  );

  const term = new Terminal({ cursorBlink: true, convertEol: false, scrollback: 5000, fontSize: 14 });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(screen);
  const encoder = new TextEncoder();
  let ws = null;
  let writer = false;
  let lastSeq = 0;
  let ended = false;

  function showRole() {
    role.textContent = writer ? 'You have control (writer)' : 'Read only';
    role.className = `role ${writer ? 'writer' : 'reader'}`;
    role.dataset.writer = writer ? '1' : '0';
    take.hidden = writer;
    release.hidden = !writer;
  }

  function sendResize() {
    // The size xterm.js has now: the test compares it with the `resized`
    // notice and with `stty size` on the PTY.
    screen.dataset.size = `${term.cols}×${term.rows}`;
    if (ws && ws.readyState === WebSocket.OPEN && writer) {
      ws.send(JSON.stringify({ type: 'resize', cols: term.cols, rows: term.rows }));
    }
  }

  function attach(write) {
    if (ws) {
      ws.onclose = null;
      ws.close(1000);
    }
    writer = false;
    role.textContent = 'connecting…';
    const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
    // A fresh stream replays the scrollback: start from the next chunk
    // when re-attaching so the screen is not written twice.
    const from = lastSeq ? `&fromSeq=${lastSeq + 1}` : '';
    const sock = new WebSocket(`${proto}//${location.host}${path}/attach?write=${write ? 1 : 0}${from}`, ['bmx.terminal.v1']);
    sock.binaryType = 'arraybuffer';
    ws = sock;
    sock.onmessage = (ev) => {
      if (typeof ev.data === 'string') {
        let n;
        try {
          n = JSON.parse(ev.data);
        } catch (_) {
          return;
        }
        if (n.type === 'attached') {
          writer = !!n.writer;
          showRole();
          clear(msg);
          fit.fit();
          sendResize();
        } else if (n.type === 'error' && n.reason === 'not_writer') {
          writer = false;
          showRole();
          clear(msg).append(errorText('Another viewer took control: this one is read only now.'));
        } else if (n.type === 'error') {
          clear(msg).append(errorText(n.message || n.reason));
        } else if (n.type === 'resized') {
          status.textContent = `${n.cols}×${n.rows}`;
        } else if (n.type === 'exited') {
          ended = true;
          status.textContent = `exited ${n.exitCode}`;
        }
        return;
      }
      const b = new Uint8Array(ev.data);
      if (b.length < 9) return;
      const op = b[0];
      const seq = Number(new DataView(ev.data).getBigUint64(1));
      if (op !== OP_OUTPUT && op !== OP_SNAPSHOT) return;
      if (seq <= lastSeq) return;
      lastSeq = seq;
      const data = b.subarray(9);
      if (op === OP_SNAPSHOT && data.length === 0) {
        term.write('\r\n\x1b[33m[earlier output was dropped from the scrollback]\x1b[0m\r\n');
      } else {
        term.write(data);
      }
    };
    sock.onclose = (ev) => {
      if (ws !== sock) return;
      writer = false;
      showRole();
      role.textContent = 'Detached';
      const why = ev.code === 4100 ? 'the terminal was closed' : ev.reason || `closed (${ev.code})`;
      status.textContent = ended ? status.textContent : why;
      if (!ended && ev.code !== 4100 && ev.code !== 1000) {
        clear(msg).append(errorText(`Relay ${why}.`), h('button', { type: 'button', onclick: () => attach(write) }, 'Re-attach'));
      }
    };
  }

  term.onData((d) => {
    if (!writer || !ws || ws.readyState !== WebSocket.OPEN) return;
    ws.send(frame(OP_INPUT, encoder.encode(d)));
  });
  term.onResize(() => sendResize());
  const onWindowResize = () => fit.fit();
  window.addEventListener('resize', onWindowResize);
  const observer = new ResizeObserver(() => fit.fit());
  observer.observe(screen);

  take.addEventListener('click', () => attach(true));
  release.addEventListener('click', () => attach(false));
  close.addEventListener('click', async () => {
    close.disabled = true;
    try {
      await del(path);
    } catch (e) {
      clear(msg).append(errorText(e));
    }
  });

  get(path)
    .then((t) => {
      // Only if no `resized` notice came first (it is newer).
      if (!status.textContent) status.textContent = `${t.cols}×${t.rows}`;
      if (t.state !== 'running') clear(msg).append(h('p', {}, 'This terminal is ', stateTag(t.state), '.'));
    })
    .catch((e) => clear(msg).append(errorText(e)));
  fit.fit();
  attach(wantWrite);
  term.focus();

  return () => {
    window.removeEventListener('resize', onWindowResize);
    observer.disconnect();
    if (ws) {
      ws.onclose = null;
      ws.close(1000);
    }
    term.dispose();
  };
}

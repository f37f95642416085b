// The harness's own figures: GET /metrics (OpenMetrics text, the format
// Prometheus scrapes; docs/reliability.md lists them), every 5 s, one
// table row per sample, grouped by metric family.

import { h, clear, errorText, every } from '../ui.js';

export const name = 'metrics';

/** OpenMetrics text → [{name, type, help, samples: [[series, value]]}]. */
export function parse(text) {
  const families = new Map();
  const family = (n) => {
    if (!families.has(n)) families.set(n, { name: n, type: '', help: '', samples: [] });
    return families.get(n);
  };
  let current = null;
  for (const line of text.split('\n')) {
    if (!line || line === '# EOF') continue;
    const meta = line.match(/^# (HELP|TYPE|UNIT) (\S+) ?(.*)$/);
    if (meta) {
      current = family(meta[2]);
      if (meta[1] === 'HELP') current.help = meta[3];
      if (meta[1] === 'TYPE') current.type = meta[3];
      continue;
    }
    if (line.startsWith('#')) continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const owner = current && m[1].startsWith(current.name) ? current : family(m[1]);
    owner.samples.push([m[1] + (m[2] || ''), m[3]]);
  }
  return [...families.values()].filter((f) => f.samples.length);
}

export function render(main) {
  const msg = h('div');
  const body = h('div');
  main.append(h('h1', {}, 'Metrics'), h('p', { class: 'muted' }, 'GET /metrics, refreshed every 5 s.'), msg, body);
  return every(5000, async () => {
    try {
      const r = await fetch('/metrics', { credentials: 'same-origin', cache: 'no-store' });
      if (!r.ok) throw new Error(`GET /metrics: HTTP ${r.status}`);
      const families = parse(await r.text());
      clear(msg);
      clear(body).append(
        h(
          'table',
          { id: 'metrics' },
          h('thead', {}, h('tr', {}, ['Metric', 'Type', 'Series', 'Value'].map((t) => h('th', {}, t)))),
          h(
            'tbody',
            {},
            families.map((f) =>
              f.samples.map(([series, value], i) =>
                h(
                  'tr',
                  { dataset: { metric: f.name } },
                  h('td', {}, i === 0 ? h('span', { title: f.help }, h('strong', {}, f.name), h('div', { class: 'muted' }, f.help)) : ''),
                  h('td', {}, i === 0 ? f.type : ''),
                  h('td', { class: 'mono' }, series),
                  h('td', { class: 'mono' }, value),
                ),
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

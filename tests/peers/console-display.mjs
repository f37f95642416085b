// A session's display in the web console (issue 20): noVNC in Debian's
// chromium (headless, playwright-core). Started by
// tests/harness/console_display.rs once the session has a display with an
// xterm on it and the pointer inside that xterm; every step must pass,
// else the exit code is 1.
//
// Environment: BMX_CONSOLE_URL (http://127.0.0.1:PORT, API token
// BMX_API_TOKEN), BMX_SESSION_ID, BMX_SHOTS (directory for screenshots).

import { chromium } from 'playwright-core';
import { mkdtempSync, mkdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { CHROMIUM_ARGS } from './chromium-args.mjs';

const url = process.env.BMX_CONSOLE_URL;
const token = process.env.BMX_API_TOKEN;
const sid = process.env.BMX_SESSION_ID;
const shots = process.env.BMX_SHOTS;
if (!url || !token || !sid || !shots) {
  console.error('console-display.mjs: BMX_CONSOLE_URL, BMX_API_TOKEN, BMX_SESSION_ID and BMX_SHOTS are required');
  process.exit(2);
}
mkdirSync(shots, { recursive: true });

// Generous: the machine may be busy building. No timing is asserted.
const WAIT = 60_000;
// The display's size (the executor's Xvfb screen).
const SCREEN = { width: 1280, height: 800 };

function step(name) {
  console.log(`step: ${name}`);
}

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

/** The API with the bearer token (not through the page). */
async function api(method, path, body) {
  const r = await fetch(`${url}${path}`, {
    method,
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  return { status: r.status, body: await r.json().catch(() => null) };
}

/** A shell command in the session's workspace (the `bash` tool); its text. */
async function sh(command) {
  const r = await api('POST', `/v1/sessions/${encodeURIComponent(sid)}/tools`, { tool: 'bash', input: { command } });
  check(r.status === 200, `bash tool: ${r.status} ${JSON.stringify(r.body)}`);
  return (r.body.content || []).map((c) => c.text || '').join('\n');
}

/** A digest of the canvas's pixels in the xterm's corner of the screen
 * (the framebuffer's own coordinates, whatever the scaling). */
async function xtermPixels(page) {
  return page.$eval('#display canvas', (c) => {
    const px = c.getContext('2d').getImageData(0, 0, 480, 320).data;
    let h = 0;
    for (let i = 0; i < px.length; i += 1) h = (Math.imul(h, 31) + px[i]) | 0;
    return h;
  });
}

/** Click the display at screen coordinates (x, y) of the remote screen. */
async function clickScreen(page, x, y) {
  const box = await page.locator('#display canvas').boundingBox();
  check(box, 'the canvas is laid out');
  await page.mouse.click(box.x + (x * box.width) / SCREEN.width, box.y + (y * box.height) / SCREEN.height);
}

async function connectedAgain(page, after) {
  await page.waitForFunction(
    (after) => {
      const d = document.querySelector('#display');
      return d?.dataset.state === 'connected' && Number(d.dataset.connections) > after;
    },
    after,
    { timeout: WAIT },
  );
}

const userData = mkdtempSync(join(tmpdir(), 'bmx-console-display-chromium-'));
let context = null;
let failed = false;
try {
  context = await chromium.launchPersistentContext(userData, {
    executablePath: '/usr/bin/chromium',
    headless: true,
    args: CHROMIUM_ARGS,
    viewport: { width: 1200, height: 800 },
  });
  const page = context.pages()[0] || (await context.newPage());
  const cspErrors = [];
  const pageErrors = [];
  page.on('console', (m) => {
    if (/Content Security Policy/i.test(m.text())) cspErrors.push(m.text());
  });
  page.on('pageerror', (e) => {
    pageErrors.push(e.message);
    console.error(`page error: ${e.message}`);
  });

  step('log in and open the session');
  await page.goto(`${url}/`);
  await page.waitForSelector('#login-form', { timeout: WAIT });
  await page.fill('#token', token);
  await page.click('#login-form button[type=submit]');
  await page.waitForSelector('#executors', { timeout: WAIT });
  await page.goto(`${url}/#/sessions/${encodeURIComponent(sid)}`);

  step('the session page links its display; noVNC connects, view only');
  await page.waitForSelector('#display-link:not([hidden])', { timeout: WAIT });
  await page.click('#display-link');
  await page.waitForSelector('#display[data-state="connected"]', { timeout: WAIT });
  const geometry = await page.$eval('#display', (d) => {
    const c = d.querySelector('canvas');
    return { width: c.width, height: c.height, shown: document.querySelector('#display-size').textContent, data: [d.dataset.width, d.dataset.height], control: d.dataset.control };
  });
  check(geometry.width === SCREEN.width && geometry.height === SCREEN.height, `the canvas has the display's geometry: ${JSON.stringify(geometry)}`);
  check(geometry.shown === `${SCREEN.width}×${SCREEN.height}`, `the page shows the geometry: ${JSON.stringify(geometry)}`);
  check(geometry.control === '0', 'the page starts view only');
  check((await page.textContent('#display-state')).includes('view only'), 'the state says view only');
  check((await page.getAttribute('#take-over', 'aria-pressed')) === 'false', 'take over is not pressed');

  step('scale to fit, and off');
  const fitted = await page.locator('#display canvas').boundingBox();
  const box = await page.locator('#display').boundingBox();
  check(fitted.width <= box.width + 1 && fitted.height <= box.height + 1, `the canvas fits its box: ${JSON.stringify({ fitted, box })}`);
  check(fitted.width < SCREEN.width, `the canvas is scaled down: ${JSON.stringify(fitted)}`);
  check(Math.abs(fitted.width / fitted.height - SCREEN.width / SCREEN.height) < 0.02, `the aspect is kept: ${JSON.stringify(fitted)}`);
  await page.uncheck('#scale-to-fit');
  await page.waitForFunction((w) => Math.round(document.querySelector('#display canvas').getBoundingClientRect().width) === w, SCREEN.width, { timeout: WAIT });
  await page.check('#scale-to-fit');
  await page.waitForFunction((w) => document.querySelector('#display canvas').getBoundingClientRect().width < w, SCREEN.width, { timeout: WAIT });
  // The xterm is drawn: some pixel of the canvas is not black.
  await page.waitForFunction(
    () => {
      const c = document.querySelector('#display canvas');
      const px = c.getContext('2d').getImageData(0, 0, 200, 200).data;
      for (let i = 0; i < px.length; i += 4) if (px[i] || px[i + 1] || px[i + 2]) return true;
      return false;
    },
    null,
    { timeout: WAIT },
  );
  await page.screenshot({ path: join(shots, 'display-view-only.png') });

  step('view only: keys and clicks on the canvas go nowhere');
  await clickScreen(page, 100, 100);
  await page.focus('#display canvas');
  await page.keyboard.type('echo no > no.txt');
  await page.keyboard.press('Enter');

  step('take over and type into the xterm');
  await page.click('#take-over');
  await page.waitForSelector('#display[data-control="1"]', { timeout: WAIT });
  check((await page.getAttribute('#take-over', 'aria-pressed')) === 'true', 'take over is pressed');
  check((await page.textContent('#display-state')).includes('you have the mouse and keyboard'), 'the state says so');
  const shown = await xtermPixels(page);
  await clickScreen(page, 100, 100);
  await page.keyboard.type('echo $((6*7)) > out.txt');
  await page.keyboard.press('Enter');
  const deadline = Date.now() + WAIT;
  let seen = '';
  for (;;) {
    seen = await sh('cat out.txt 2>/dev/null; test -e no.txt && echo NO_TXT_EXISTS; true');
    if (/stdout:\n42\n/.test(seen)) break;
    check(Date.now() < deadline, `out.txt never held 42: ${seen}`);
    await new Promise((r) => setTimeout(r, 200));
  }
  // The shell ran the taken-over line; anything typed before it (in view
  // only mode) would have run first.
  check(!seen.includes('NO_TXT_EXISTS'), `keys typed in view-only mode reached the shell: ${seen}`);
  // And the viewer sees what was typed (x11vnc sends the change back).
  await page.waitForFunction(
    (shown) => {
      const px = document.querySelector('#display canvas').getContext('2d').getImageData(0, 0, 480, 320).data;
      let h = 0;
      for (let i = 0; i < px.length; i += 1) h = (Math.imul(h, 31) + px[i]) | 0;
      return h !== shown;
    },
    shown,
    { timeout: WAIT },
  );
  await page.screenshot({ path: join(shots, 'display-taken-over.png') });

  step('reconnect: a new one-time ticket, still taken over');
  const before = Number(await page.getAttribute('#display', 'data-connections'));
  await page.click('#reconnect');
  await connectedAgain(page, before);
  check((await page.getAttribute('#display', 'data-control')) === '1', 'the choice survives a reconnect');
  await clickScreen(page, 100, 100);
  await page.keyboard.type('echo again > again.txt');
  await page.keyboard.press('Enter');
  for (const end = Date.now() + WAIT; ; ) {
    if (/stdout:\nagain\n/.test(await sh('cat again.txt 2>/dev/null; true'))) break;
    check(Date.now() < end, 'again.txt never appeared after the reconnect');
    await new Promise((r) => setTimeout(r, 200));
  }

  step('the session ends: the page says so, and a reconnect shows the harness error');
  const ended = await api('DELETE', `/v1/sessions/${encodeURIComponent(sid)}`);
  check(ended.status === 200, `DELETE the session: ${ended.status}`);
  await page.waitForSelector('#display-state[data-state="disconnected"]', { timeout: WAIT });
  check((await page.textContent('#display-message')).includes('ended'), 'the message says the stream ended');
  check((await page.textContent('#display-size')) === '', 'no geometry is shown for a closed stream');
  await page.click('#reconnect');
  await page.waitForSelector('#display-state[data-state="error"]', { timeout: WAIT });
  const refusal = await page.textContent('#display-message');
  check(/\((404|410)\b/.test(refusal) && /code -?\d+/.test(refusal), `the harness's refusal is shown with its status and code: ${refusal}`);
  await page.screenshot({ path: join(shots, 'display-ended.png') });

  step('no Content-Security-Policy violation, no page error');
  check(cspErrors.length === 0, `CSP violations: ${cspErrors.join('\n')}`);
  check(pageErrors.length === 0, `page errors: ${pageErrors.join('\n')}`);
  step('done');
} catch (e) {
  failed = true;
  console.error(`console-display.mjs: ${e.stack || e}`);
} finally {
  if (context) await context.close().catch(() => {});
  rmSync(userData, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);

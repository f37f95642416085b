// The web console in a real browser (issue 16): Debian's chromium, headless,
// driven by playwright-core. Started by tests/harness/console.rs with a real
// harness and executor; every step must pass, else the exit code is 1.
//
// Environment: BMX_CONSOLE_URL (http://127.0.0.1:PORT, API token
// BMX_API_TOKEN, executor BMX_EXECUTOR_ID), BMX_OPEN_URL (a harness without
// an API token), BMX_SHOTS (directory for screenshots).

import { chromium } from 'playwright-core';
import { mkdtempSync, mkdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { CHROMIUM_ARGS } from './chromium-args.mjs';

const url = process.env.BMX_CONSOLE_URL;
const token = process.env.BMX_API_TOKEN;
const executor = process.env.BMX_EXECUTOR_ID;
const openUrl = process.env.BMX_OPEN_URL;
const shots = process.env.BMX_SHOTS;
if (!url || !token || !executor || !openUrl || !shots) {
  console.error('console.mjs: BMX_CONSOLE_URL, BMX_API_TOKEN, BMX_EXECUTOR_ID, BMX_OPEN_URL and BMX_SHOTS are required');
  process.exit(2);
}
mkdirSync(shots, { recursive: true });

// Generous: the machine may be busy building. No timing is asserted.
const WAIT = 60_000;

function step(name) {
  console.log(`step: ${name}`);
}

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

/** The text of the xterm.js screen, one string per row. */
async function screenRows(page) {
  return page.$$eval('#terminal .xterm-rows > div', (rows) => rows.map((r) => r.textContent.replace(/\u00a0/g, ' ').trimEnd()));
}

/** Wait until a row of the screen is `line`, or (`line` null) until
 * `stty size` answered at least `count` times. (No `new Function` in the
 * page: its CSP allows no eval.) */
async function waitRows(page, what, line, count = 1) {
  await page
    .waitForFunction(
      ([line, count]) => {
        const rows = [...document.querySelectorAll('#terminal .xterm-rows > div')].map((r) => r.textContent.replace(/\u00a0/g, ' ').trim());
        if (line !== null) return rows.some((r) => r === line);
        return rows.filter((r) => /^\d+ \d+$/.test(r)).length >= count;
      },
      [line, count],
      { timeout: WAIT },
    )
    .catch(async (e) => {
      throw new Error(`${what}: ${e.message}\nscreen:\n${(await screenRows(page)).join('\n')}`);
    });
}

function sttyLines(rows) {
  return rows.filter((r) => /^\d+ \d+$/.test(r.trim())).map((r) => r.trim());
}

async function login(page, tok) {
  await page.goto(`${url}/`);
  await page.waitForSelector('#login-form', { timeout: WAIT });
  await page.fill('#token', tok);
  await page.click('#login-form button[type=submit]');
}

const userData = [];
function freshDir() {
  const d = mkdtempSync(join(tmpdir(), 'bmx-console-chromium-'));
  userData.push(d);
  return d;
}

const args = CHROMIUM_ARGS;

async function launch() {
  // A persistent context per "browser" gives each its own fresh
  // user-data-dir (cookies not shared).
  return chromium.launchPersistentContext(freshDir(), {
    executablePath: '/usr/bin/chromium',
    headless: true,
    args,
    viewport: { width: 1200, height: 800 },
  });
}

const contexts = [];
let failed = false;
try {
  const a = await launch();
  contexts.push(a);
  const page = a.pages()[0] || (await a.newPage());
  const cspErrors = [];
  page.on('console', (m) => {
    if (/Content Security Policy/i.test(m.text())) cspErrors.push(m.text());
  });
  page.on('pageerror', (e) => console.error(`page error: ${e.message}`));

  step('a wrong token is refused');
  await login(page, `${token}-wrong`);
  await page.waitForFunction(() => document.querySelector('#login-error')?.textContent === 'Wrong token.', null, { timeout: WAIT });
  await page.screenshot({ path: join(shots, 'login.png') });
  const unauth = await page.evaluate(() => fetch('/v1/executors').then((r) => r.status));
  check(unauth === 401, `the API without a session answers 401 (got ${unauth})`);

  step('log in and see the executor');
  await page.fill('#token', token);
  await page.click('#login-form button[type=submit]');
  await page.waitForSelector(`#executors tr[data-executor="${executor}"]`, { timeout: WAIT });
  const cookies = await a.cookies(url);
  const c = cookies.find((k) => k.name === 'bmx_console');
  check(c && c.httpOnly && c.sameSite === 'Strict', `the session cookie is HttpOnly and SameSite=Strict: ${JSON.stringify(cookies)}`);
  // The age of the last heartbeat, once there was one.
  await page.waitForFunction(
    (id) => /\d+ (s|min|h) ago/.test(document.querySelector(`#executors tr[data-executor="${id}"] .heartbeat`)?.textContent || ''),
    executor,
    { timeout: WAIT },
  );
  await page.screenshot({ path: join(shots, 'executors.png') });

  step('a cookie request without the CSRF token is refused');
  const csrfless = await page.evaluate(() =>
    fetch('/v1/sessions', { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' }).then((r) => r.status),
  );
  check(csrfless === 403, `POST without x-csrf-token answers 403 (got ${csrfless})`);

  step('start a process from the page and watch 42 appear');
  await page.goto(`${url}/#/sessions`);
  await page.click('#new-session');
  await page.waitForSelector('#fencing', { timeout: WAIT });
  const fencing = await page.textContent('#fencing');
  check(/^\d+$/.test(fencing.trim()), `the fencing token is shown (${fencing})`);
  await page.fill('#tool-input', '{"command": "echo tool-$((6*7))"}');
  await page.click('#call-tool button[type=submit]');
  await page.waitForFunction(() => /succeeded[\s\S]*tool-42/.test(document.querySelector('#tool-result')?.textContent || ''), null, { timeout: WAIT });
  await page.fill('#command', 'echo $((6*7))');
  await page.click('#start-process button[type=submit]');
  await page.waitForFunction(() => /(^|\n)42\n/.test(document.querySelector('#output')?.textContent || ''), null, { timeout: WAIT });
  await page.waitForSelector('#exit', { timeout: WAIT });
  check((await page.textContent('#exit')).includes('exit code 0'), 'the process exited 0');
  await page.screenshot({ path: join(shots, 'process.png') });
  await page.goBack();
  await page.waitForSelector('#processes', { timeout: WAIT });
  await page.screenshot({ path: join(shots, 'session.png') });

  step('an agent turn: streamed text, a tool call, a permission answered with a button');
  await page.waitForSelector('#agent-link:not([hidden])', { timeout: WAIT });
  await page.click('#agent-link');
  await page.waitForSelector('#prompt-form', { timeout: WAIT });
  await page.waitForFunction(() => document.querySelector('main')?.dataset.streaming === '1', null, { timeout: WAIT });
  await page.fill('#prompt', 'hi there');
  await page.click('#prompt-form button[type=submit]');
  await page.waitForFunction(
    () => [...document.querySelectorAll('.entry.message .entry-body')].some((e) => e.textContent === 'Hello, you said: hi there'),
    null,
    { timeout: WAIT },
  );
  await page.waitForSelector('.entry.tool[data-status="completed"]', { timeout: WAIT });
  await page.waitForFunction(() => document.querySelector('#turn-status')?.dataset.outcome === 'completed', null, { timeout: WAIT });
  await page.fill('#prompt', 'permission please');
  await page.click('#prompt-form button[type=submit]');
  await page.waitForSelector('.entry.interaction[data-state="pending"] button.allow', { timeout: WAIT });
  await page.screenshot({ path: join(shots, 'turn-permission.png') });
  await page.click('.entry.interaction[data-state="pending"] button.allow');
  await page.waitForSelector('.entry.interaction[data-state="answered"]', { timeout: WAIT });
  await page.waitForFunction(
    () => [...document.querySelectorAll('.entry.message .entry-body')].some((e) => e.textContent.includes('allowed')),
    null,
    { timeout: WAIT },
  );
  await page.waitForFunction(() => document.querySelectorAll('.entry.tool[data-status="completed"]').length >= 2, null, { timeout: WAIT });
  await page.screenshot({ path: join(shots, 'turn.png') });
  await page.goto(`${url}/#/sessions`);
  await page.waitForSelector('#sessions', { timeout: WAIT });
  await page.screenshot({ path: join(shots, 'sessions.png') });

  step('open a terminal and type into xterm.js');
  await page.goto(`${url}/#/executors`);
  await page.click(`#executors tr[data-executor="${executor}"] .new-terminal`);
  await page.waitForSelector('#role[data-writer="1"]', { timeout: WAIT });
  const termUrl = page.url().replace(/\?write=1$/, '');
  await page.click('#terminal');
  await page.keyboard.type('echo $((6*7))\n');
  await waitRows(page, 'the shell prints 42', '42');
  await page.screenshot({ path: join(shots, 'terminal.png') });

  step('resize the viewport: stty size follows');
  // The PTY has the size xterm.js fitted to (the relay's `resized` notice).
  const fitted = async (old) =>
    page.waitForFunction(
      (old) => {
        const size = document.querySelector('#terminal')?.dataset.size;
        const shown = document.querySelector('#terminal-status')?.textContent.trim();
        return size && size !== old && shown === size ? size : null;
      },
      old,
      { timeout: WAIT },
    ).then((h) => h.jsonValue());
  const sizeBefore = await fitted(null);
  await page.keyboard.type('stty size\n');
  await waitRows(page, 'stty size answers', null, 1);
  const before = sttyLines(await screenRows(page)).at(-1);
  await page.setViewportSize({ width: 760, height: 520 });
  const sizeAfter = await fitted(sizeBefore);
  const [cols, rows] = sizeAfter.split('×');
  await page.keyboard.type('stty size\n');
  await waitRows(page, `stty size answers ${rows} ${cols}`, `${rows} ${cols}`);
  const after = sttyLines(await screenRows(page)).at(-1);
  check(after !== before, `stty size changed with the viewport (${before} at ${sizeBefore} → ${after} at ${sizeAfter})`);
  await page.screenshot({ path: join(shots, 'terminal-resized.png') });

  step('a second browser attaches read-only and cannot type');
  const b = await launch();
  contexts.push(b);
  const reader = b.pages()[0] || (await b.newPage());
  await login(reader, token);
  await reader.waitForSelector('#executors', { timeout: WAIT });
  await reader.goto(termUrl);
  await reader.waitForSelector('#role[data-writer="0"]', { timeout: WAIT });
  // The reader sees what the writer did.
  await waitRows(reader, 'the reader sees the scrollback', '42');
  await reader.click('#terminal');
  await reader.keyboard.type('echo READONLY_$((1+1))\n');
  // A barrier: the writer's next command; once its answer is on both
  // screens, anything the reader sent before would have been echoed.
  await page.keyboard.type('echo MARK_$((2+3))\n');
  await waitRows(page, 'the writer still types', 'MARK_5');
  await waitRows(reader, 'the reader sees the writer', 'MARK_5');
  for (const [who, p] of [['writer', page], ['reader', reader]]) {
    const rows = await screenRows(p);
    check(!rows.some((r) => r.includes('READONLY')), `the reader's keystrokes reached no shell (${who}'s screen):\n${rows.join('\n')}`);
  }
  await reader.screenshot({ path: join(shots, 'terminal-read-only.png') });

  step('the harness metrics page');
  await page.setViewportSize({ width: 1200, height: 800 });
  await page.goto(`${url}/#/metrics`);
  await page.waitForSelector('#metrics tbody tr', { timeout: WAIT });
  const families = await page.$$eval('#metrics tbody tr', (rows) => new Set(rows.map((r) => r.dataset.metric)).size);
  check(families >= 3, `several metric families are shown (${families})`);
  await page.screenshot({ path: join(shots, 'metrics.png') });

  step('no Content-Security-Policy violation on the pages');
  check(cspErrors.length === 0, `CSP violations: ${cspErrors.join('\n')}`);

  step('without an API token the page says it is loopback only');
  const open = await a.newPage();
  await open.goto(`${openUrl}/`);
  await open.waitForFunction(() => document.querySelector('#mode')?.dataset.loopbackOnly === '1', null, { timeout: WAIT });
  check((await open.textContent('#mode')).includes('loopback only'), 'the banner says loopback only');
  await open.waitForSelector('#executors, #no-executors', { timeout: WAIT });
  await open.screenshot({ path: join(shots, 'open-loopback.png') });
  step('done');
} catch (e) {
  failed = true;
  console.error(`console.mjs: ${e.stack || e}`);
} finally {
  for (const c of contexts) await c.close().catch(() => {});
  for (const d of userData) rmSync(d, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);

// Issue 56, item 1, in a real browser: content a session chose never runs
// on the harness's origin. Started by tests/harness/console_content.rs,
// which put an agent's `report.html` in a session (as an artifact and as a
// session output file). Its script, run on the harness's origin by a
// logged-in operator's browser, reads the console's CSRF token, creates a
// session (metadata.pwned = its own path) and runs `id > pwned.txt` with
// the bash tool. The Rust side then looks for those sessions.
//
// Steps: log in to the console; a control: the same bytes served as HTML
// on the harness's origin (a playwright route) do run and create their
// session, so the payload is live; then each real URL is opened as an
// operator would open a link: it downloads (named report.html, the same
// bytes) and no document is ever committed; then each is forced to render
// (the real answer with its Content-Disposition removed): the CSP sandbox
// gives it an opaque origin and no script runs. Last, DNS rebinding: a
// second browser resolving evil.example to 127.0.0.1 gets 403 from the
// token-less harness for every page.
//
// Environment: BMX_CONSOLE_URL, BMX_API_TOKEN, BMX_CONTENT_PATHS (paths,
// comma-separated), BMX_REPORT_HTML (the payload), BMX_OPEN_PORT (the
// token-less harness's port).

import { chromium } from 'playwright-core';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { CHROMIUM_ARGS } from './chromium-args.mjs';

const url = process.env.BMX_CONSOLE_URL;
const token = process.env.BMX_API_TOKEN;
const paths = (process.env.BMX_CONTENT_PATHS || '').split(',').filter(Boolean);
const html = process.env.BMX_REPORT_HTML;
const openPort = process.env.BMX_OPEN_PORT;
if (!url || !token || paths.length === 0 || !html || !openPort) {
  console.error('web-content.mjs: BMX_CONSOLE_URL, BMX_API_TOKEN, BMX_CONTENT_PATHS, BMX_REPORT_HTML and BMX_OPEN_PORT are required');
  process.exit(2);
}

// Generous: the machine may be busy building. No timing is asserted.
const WAIT = 60_000;

function step(name) {
  console.log(`step: ${name}`);
}

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

const userData = [];
async function launch(extra = []) {
  const d = mkdtempSync(join(tmpdir(), 'bmx-web-content-chromium-'));
  userData.push(d);
  return chromium.launchPersistentContext(d, {
    executablePath: '/usr/bin/chromium',
    headless: true,
    args: [...CHROMIUM_ARGS, ...extra],
    acceptDownloads: true,
  });
}

const contexts = [];
let failed = false;
try {
  const a = await launch();
  contexts.push(a);
  const page = a.pages()[0] || (await a.newPage());

  step('log in to the console');
  await page.goto(`${url}/`);
  await page.waitForSelector('#login-form', { timeout: WAIT });
  await page.fill('#token', token);
  await page.click('#login-form button[type=submit]');
  await page.waitForFunction(
    () => fetch('/console/session').then((r) => r.json()).then((s) => s.authenticated === true),
    null,
    { timeout: WAIT, polling: 200 },
  );

  step('control: the payload served as HTML on the harness origin runs');
  const control = `${url}/control/report.html`;
  await a.route(control, (route) => route.fulfill({ status: 200, contentType: 'text/html', body: html }));
  await page.goto(control);
  await page.waitForFunction(() => document.title === 'PWNED', null, { timeout: WAIT });
  await a.unroute(control);

  for (const path of paths) {
    const target = `${url}${path}`;

    step(`${path}: opening it downloads it, nothing is rendered`);
    const p = await a.newPage();
    const [download] = await Promise.all([
      p.waitForEvent('download', { timeout: WAIT }),
      p.goto(target).catch(() => null),
    ]);
    check(download.suggestedFilename() === 'report.html', `the download is named report.html (${download.suggestedFilename()})`);
    const saved = readFileSync(await download.path(), 'utf8');
    check(saved === html, 'the download holds the session\'s bytes');
    check(p.url() === 'about:blank', `no document was committed (${p.url()})`);
    await p.close();

    step(`${path}: forced to render, it runs nothing and has no origin`);
    const q = await a.newPage();
    let served = null;
    await a.route(target, async (route) => {
      const r = await route.fetch();
      const headers = r.headers();
      served = { ...headers };
      delete headers['content-disposition'];
      // Rendered as HTML, as a browser ignoring the download would.
      headers['content-type'] = 'text/html';
      await route.fulfill({ response: r, headers });
    });
    await q.goto(target, { waitUntil: 'load' });
    await a.unroute(target);
    check(/sandbox/.test(served['content-security-policy'] || ''), `CSP sandbox: ${JSON.stringify(served)}`);
    check(served['x-content-type-options'] === 'nosniff', 'nosniff');
    check(/^attachment;/.test(served['content-disposition'] || ''), 'attachment');
    const title = await q.title();
    check(title !== 'RAN' && title !== 'PWNED', `no script ran (title ${title})`);
    const origin = await q.evaluate(() => window.origin);
    check(origin === 'null', `an opaque origin (${origin})`);
    await q.close();
  }

  step('DNS rebinding: a rebound name gets 403 from the token-less harness');
  // Chromium's own guard against public pages reaching loopback (Private
  // / Local Network Access) is turned off: the harness must hold without
  // it, as it must for browsers that have none.
  const b = await launch([
    '--host-resolver-rules=MAP evil.example 127.0.0.1',
    '--disable-features=BlockInsecurePrivateNetworkRequests,PrivateNetworkAccessSendPreflights,PrivateNetworkAccessRespectPreflightResults,LocalNetworkAccessChecks',
  ]);
  contexts.push(b);
  const r = b.pages()[0] || (await b.newPage());
  for (const path of ['/', '/v1/executors', '/v1/sessions', '/console/session']) {
    const resp = await r.goto(`http://evil.example:${openPort}${path}`);
    check(resp.status() === 403, `${path} on evil.example answers 403 (${resp.status()})`);
    check((await resp.text()).includes('not_loopback'), `${path}: reason not_loopback`);
  }
  // The attacker's own page on evil.example (served before the name was
  // rebound: here by a route), whose same-origin requests now reach the
  // harness with Host evil.example.
  const attack = `http://evil.example:${openPort}/attack.html`;
  await b.route(attack, (route) => route.fulfill({ status: 200, contentType: 'text/html', body: '<!doctype html><title>attack</title>' }));
  await r.goto(attack);
  const seen = await r.evaluate(async () => {
    const get = await fetch('/v1/executors');
    const post = await fetch('/v1/sessions', { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' });
    return [get.status, post.status, await get.text()];
  });
  check(seen[0] === 403 && seen[1] === 403, `a rebound page's GET and POST answer 403 (${seen})`);
  check(seen[2].includes('not_loopback'), `reason not_loopback (${seen[2]})`);
  const own = await r.goto(`http://127.0.0.1:${openPort}/v1/executors`);
  check(own.status() === 200, `the loopback name itself is served (${own.status()})`);

  step('done');
} catch (e) {
  failed = true;
  console.error(`web-content.mjs: ${e.stack || e}`);
} finally {
  for (const c of contexts) await c.close().catch(() => {});
  for (const d of userData) rmSync(d, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);

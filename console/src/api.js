// The HTTP API as the page uses it: fetch with the session cookie (sent
// by the browser, never seen by this script) and, on state-changing
// requests, the CSRF token the login gave (docs/console.md).

let csrf = null;

export function setCsrf(token) {
  csrf = token || null;
}

export class ApiError extends Error {
  constructor(status, body) {
    const e = body && body.error;
    super(e ? `${e.message} (${status}${e.data && e.data.reason ? ', ' + e.data.reason : ''})` : `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

export async function api(method, path, body) {
  const headers = { accept: 'application/json' };
  if (body !== undefined) headers['content-type'] = 'application/json';
  if (csrf && method !== 'GET' && method !== 'HEAD') headers['x-csrf-token'] = csrf;
  const r = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: 'same-origin',
    cache: 'no-store',
  });
  let v = null;
  try {
    v = await r.json();
  } catch (_) {
    v = null;
  }
  if (!r.ok) throw new ApiError(r.status, v);
  return v;
}

export const get = (p) => api('GET', p);
export const post = (p, b) => api('POST', p, b === undefined ? {} : b);
export const del = (p) => api('DELETE', p);

/** Path segment. */
export const seg = (s) => encodeURIComponent(s);

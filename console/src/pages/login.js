// Login: the API token, exchanged for an HttpOnly session cookie and a
// CSRF token (POST /console/login).

import { post, setCsrf } from '../api.js';
import { h } from '../ui.js';

export const name = 'login';

export function render(main, _params, _query, app) {
  const input = h('input', { type: 'password', id: 'token', name: 'token', autocomplete: 'current-password', placeholder: 'API token', required: true });
  const msg = h('p', { class: 'error', id: 'login-error', role: 'alert' });
  const form = h(
    'form',
    { class: 'row', id: 'login-form' },
    input,
    h('button', { type: 'submit', class: 'primary' }, 'Log in'),
  );
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    msg.textContent = '';
    try {
      const r = await post('/console/login', { token: input.value });
      setCsrf(r.csrf);
      input.value = '';
      await app.refresh();
      location.hash = '#/executors';
    } catch (e) {
      msg.textContent = e.status === 401 ? 'Wrong token.' : String(e.message || e);
    }
  });
  main.append(
    h(
      'section',
      { class: 'login' },
      h('h1', {}, 'bmx console'),
      h('p', { class: 'muted' }, 'Log in with the harness API token (--api-token). The browser keeps an HttpOnly session cookie for 12 hours.'),
      form,
      msg,
    ),
  );
  input.focus();
}

// The flags both console browser tests start Debian's chromium with:
// headless, no sandbox (CI runs as root), and nothing that reaches out to
// the network on its own.
export const CHROMIUM_ARGS = [
  '--headless',
  '--no-sandbox',
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
];
